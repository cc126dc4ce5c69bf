"""Measure issue 11's routing targets: KV-aware routing against round-robin on multi-turn chat, 2 workers against 1.

1. Multi-turn chat (N conversations x M turns, each turn's prompt the whole history so far): a fresh suite of
   1 scheduler + 2 workers + 1 gateway with `--routing kv`, then a fresh one with `--routing round-robin`, the
   same conversations (same seed) on both. Reports TTFT (mean, p50, p99), the TTFT ratio round-robin / kv
   (target >= 2x) and the prefix-cache hit rates (the scheduler's GetStats over the run, and the client's
   cached tokens).
2. A mixed random workload on 2 workers, then on 1 worker: output tok/s and their ratio. On a machine with
   fewer cores than workers need, both workers share the same cores, so this ratio measures scheduling
   overhead and cache effects, not scale-out.

The chat trace (--chat-trace): `document` opens each conversation with a long turn (a pasted document or
system prompt, 1000-1400 tokens) and goes on with short questions (20-60 tokens), the shape of most chat
traffic; `even` gives every turn 150-250 new tokens. What kv routing saves is the history a worker would
recompute, so the TTFT ratio grows with the history's share of each prompt.

Writes routing-TRACE.json into --out-dir and prints a markdown table for docs/benchmarks.md.

    python scripts/bench_routing.py            # default sizes, 3 runs per side (about 12 minutes, 2 quiet cores)
    python scripts/bench_routing.py --quick    # smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
import typing
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings

from services.client.bench.cache_stats import CacheReport, fetch_stats, stats_delta
from services.client.bench.cpu_ticks import machine_ticks, process_ticks
from services.client.bench.datasets import (
    BenchRequest,
    Conversation,
    multi_turn_dataset,
    random_dataset,
    single_turns,
    turn_indices,
)
from services.client.bench.metrics import BenchSummary, mean_ttft_by_turn, summarize
from services.client.bench.provenance import cpu_model, git_commit
from services.client.bench.runner import run_benchmark, run_conversations
from services.client.launcher import Launcher, start_suite_processes, wait_all_healthy
from services.common.ports import free_port

ROOT = Path(__file__).resolve().parent.parent

ROUTING_MODES = ("kv", "round-robin")
PARTS = ("chat", "throughput")
STARTUP_TIMEOUT_S = 600.0
TTFT_TARGET = 2.0
# Different seeds, so no mixed or warm-up prompt is a prefix-cache hit for a conversation.
SEED_CHAT, SEED_MIXED, SEED_WARMUP = 11, 12, 13

Range = tuple[int, int]


@dataclass(frozen=True)
class Plan:
    """Workload sizes: FULL (the default) is what docs/benchmarks.md reports, QUICK a smoke run."""

    num_conversations: int
    num_turns: int
    turn_input: Range
    turn_output: Range
    # The opening turn's new tokens (None: turn_input, like every other turn).
    first_turn_input: Range | None
    # Conversations in flight at once (each keeps its slot for all of its turns).
    chat_concurrency: int
    # Conversation starts per second (gamma arrivals, as `meshserve bench --request-rate`); inf: all at once.
    chat_request_rate: float
    mixed_prompts: int
    mixed_input: Range
    mixed_output: Range
    mixed_concurrency: int
    # Per worker: enough for every conversation's whole history, so no routing mode loses hits to eviction.
    kv_cache_memory: str
    # Above the longest conversation; the worker refuses a KV cache too small for one such sequence.
    max_model_len: int


FULL = Plan(
    num_conversations=8,
    num_turns=6,
    # Ranges, not fixed lengths: with equal turns every conversation would finish its turns in lockstep, and
    # whether round-robin sends a conversation back to the same worker would hang on the arrival order.
    turn_input=(150, 250),
    turn_output=(16, 48),
    first_turn_input=None,
    chat_concurrency=8,
    chat_request_rate=math.inf,
    mixed_prompts=32,
    mixed_input=(32, 512),
    mixed_output=(16, 96),
    mixed_concurrency=16,
    kv_cache_memory="1GiB",
    max_model_len=4096,
)

QUICK = Plan(
    num_conversations=4,
    num_turns=3,
    turn_input=(64, 64),
    turn_output=(8, 8),
    first_turn_input=None,
    chat_concurrency=4,
    chat_request_rate=math.inf,
    mixed_prompts=8,
    mixed_input=(16, 64),
    mixed_output=(4, 16),
    mixed_concurrency=4,
    kv_cache_memory="256MiB",
    max_model_len=1024,
)


def log(message: str) -> None:
    """Progress on stderr, with a timestamp, so stdout carries only the results."""
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, inf when the denominator is 0."""
    return numerator / denominator if denominator > 0 else math.inf


def check_routing_support(modes: Iterable[str], settings: type[BaseSettings] | None = None) -> None:
    """SystemExit naming what is missing when the scheduler (settings) has no --routing flag, or lacks a mode."""
    if settings is None:
        from services.scheduler.settings import SchedulerSettings

        settings = SchedulerSettings
    field = settings.model_fields.get("routing")
    if field is None:
        raise SystemExit(
            "error: the scheduler has no --routing flag (services/scheduler/settings.py has no `routing` "
            "setting); this benchmark compares its kv and round-robin modes"
        )
    choices = typing.get_args(field.annotation)
    if missing := sorted(m for m in modes if choices and m not in choices):
        raise SystemExit(f"error: the scheduler's --routing takes {', '.join(choices)}, not {', '.join(missing)}")


# ---------------------------------------------------------------------------------------------- suite


@dataclass(frozen=True)
class SuiteSpec:
    """One suite's shape: how many workers, which routing, how many compute threads per worker."""

    num_workers: int
    routing: str
    worker_threads: int
    kv_cache_memory: str
    max_model_len: int
    # A kvstore (memory backend) shared by the workers.
    kv_store: bool = False
    # More scheduler flags, the same for every suite of a run (e.g. --long-prefill-token-threshold 256).
    scheduler_args: tuple[str, ...] = ()

    def describe(self) -> str:
        store = ", kvstore on" if self.kv_store else ""
        extra = f", scheduler {' '.join(self.scheduler_args)}" if self.scheduler_args else ""
        threads = f"{self.worker_threads} thread(s) each"
        return f"{self.num_workers} worker(s), --routing {self.routing}, {threads}{store}{extra}"


class Suite:
    """A running scheduler + workers + gateway on free loopback ports; stop() ends them."""

    def __init__(self, spec: SuiteSpec, model_dir: Path, log_dir: Path) -> None:
        # OMP_NUM_THREADS sizes each worker's torch pool: workers on shared cores split them rather than each
        # starting a thread per core and fighting over them.
        env = {
            "MESHSERVE_LOG_LEVEL": "warning",
            "MESHSERVE_LOG_FORMAT": "json",
            "OMP_NUM_THREADS": str(spec.worker_threads),
        }
        self.launcher = Launcher(log_dir, env=env)
        try:
            procs = start_suite_processes(
                self.launcher,
                model=str(model_dir),
                host="127.0.0.1",
                scheduler_port=free_port(),
                worker_ports=[free_port() for _ in range(spec.num_workers)],
                gateway_port=free_port(),
                scheduler_args=["--routing", spec.routing, *spec.scheduler_args],
                worker_args=["--kv-cache-memory", spec.kv_cache_memory, "--max-model-len", str(spec.max_model_len)],
                kv_store_port=free_port() if spec.kv_store else None,
            )
            asyncio.run(wait_all_healthy(self.launcher, procs.all, STARTUP_TIMEOUT_S))
        except BaseException:
            self.launcher.stop_all(timeout=10)
            raise
        self.address = procs.gateway.address
        self.scheduler_address = procs.scheduler.address
        self.kv_store_address = procs.kv_store.address if procs.kv_store is not None else None
        self.pids = [p.process.pid for p in procs.all]

    def stop(self) -> None:
        """SIGTERM everything, gateway first."""
        self.launcher.stop_all(timeout=30)


@contextmanager
def running_suite(spec: SuiteSpec, model_dir: Path, log_dir: Path) -> Iterator[Suite]:
    """A fresh suite for the duration of the with-block (fresh: its prefix caches start empty)."""
    started = time.perf_counter()
    try:
        suite = Suite(spec, model_dir, log_dir)
    except (RuntimeError, TimeoutError) as err:
        # The launcher's message holds the failing service's log tail; a rejected flag shows up there.
        raise SystemExit(f"error: the suite ({spec.describe()}) did not start: {err}") from None
    log(f"suite up ({spec.describe()}) in {time.perf_counter() - started:.0f}s")
    try:
        yield suite
    finally:
        suite.stop()


# ---------------------------------------------------------------------------------------------- machine load

# Other engineers' jobs on a shared machine skew every timing; a run waits for them to end, up to a point.
QUIET_SHARE = 0.15
QUIET_WINDOW_S = 2.0
QUIET_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CpuSample:
    """CPU jiffies since boot: the machine's busy and total, and those of this script and its suite."""

    busy: int
    total: int
    ours: int


def cpu_sample(pids: Sequence[int]) -> CpuSample | None:
    """Now; None where there is no /proc (not Linux)."""
    try:
        busy, total = machine_ticks()
    except OSError:
        return None
    return CpuSample(busy, total, sum(process_ticks(p) for p in (os.getpid(), *pids)))


def other_share(a: CpuSample | None, b: CpuSample | None) -> float | None:
    """Fraction of the machine's CPU time that other processes used between two samples."""
    if a is None or b is None or b.total <= a.total:
        return None
    return max(0.0, ((b.busy - a.busy) - (b.ours - a.ours)) / (b.total - a.total))


async def wait_until_quiet(pids: Sequence[int], timeout_s: float = QUIET_TIMEOUT_S) -> float | None:
    """Wait until other processes use at most QUIET_SHARE of the CPUs; returns their last measured share."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        first = cpu_sample(pids)
        await asyncio.sleep(QUIET_WINDOW_S)
        share = other_share(first, cpu_sample(pids))
        if share is None or share <= QUIET_SHARE:
            return share
        if time.monotonic() > deadline:
            log(f"warning: other processes still use {share:.0%} of the CPUs; measuring anyway")
            return share
        if not waited:
            log(f"other processes use {share:.0%} of the CPUs; waiting for them (up to {timeout_s:.0f}s)")
            waited = True


# ---------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One timed workload on one suite: its summary, the scheduler's counters, TTFT by turn."""

    name: str
    spec: SuiteSpec
    summary: BenchSummary
    cache: CacheReport
    mean_ttft_ms_by_turn: list[float | None]
    # Share of the CPUs other processes used during the timed run (None: unknown); above QUIET_SHARE the
    # figures are suspect.
    other_cpu_share: float | None = None

    @property
    def client_hit_rate(self) -> float:
        """Prompt tokens the gateway reported as cached / prompt tokens sent."""
        return ratio(self.summary.total_cached_tokens, self.summary.total_input_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "suite": asdict(self.spec),
            "client_prefix_cache_hit_rate": self.client_hit_rate,
            "mean_ttft_ms_by_turn": self.mean_ttft_ms_by_turn,
            "other_cpu_share": self.other_cpu_share,
            "scheduler_stats": self.cache.to_dict(),
            "summary": self.summary.to_dict(),
        }


def checked(summary: BenchSummary) -> BenchSummary:
    """A summary whose requests all completed with exactly the tokens they asked for; else RuntimeError."""
    if summary.failed or summary.output_len_mismatches:
        raise RuntimeError(
            f"{summary.failed} failed, {summary.output_len_mismatches} with a wrong token count; "
            f"errors: {summary.errors}"
        )
    return summary


async def _warm_up(suite: Suite, warmup: list[BenchRequest]) -> None:
    # All at once, so that load-aware routing spreads them and every worker runs its first steps untimed.
    records, _ = await run_benchmark(suite.address, warmup, progress=False)
    if failed := [r.error for r in records if not r.success]:
        raise RuntimeError(f"warm-up failed: {failed[0]}")


async def _measure(
    name: str, spec: SuiteSpec, suite: Suite, conversations: list[Conversation], concurrency: int,
    warmup: list[BenchRequest], request_rate: float,
) -> Run:  # fmt: skip
    await _warm_up(suite, warmup)
    await wait_until_quiet(suite.pids)
    before, cpu_before = await fetch_stats(suite.scheduler_address), cpu_sample(suite.pids)
    records, duration = await run_conversations(
        suite.address, conversations, request_rate=request_rate, max_concurrency=concurrency, progress=False
    )
    cpu_after = cpu_sample(suite.pids)
    cache = stats_delta(before, await fetch_stats(suite.scheduler_address))
    summary = checked(summarize(records, duration, backend="meshserve", max_concurrency=concurrency))
    by_turn = mean_ttft_by_turn(records, turn_indices(conversations))
    return Run(name, spec, summary, cache, by_turn, other_share(cpu_before, cpu_after))


def measure(
    name: str,
    spec: SuiteSpec,
    model_dir: Path,
    log_dir: Path,
    conversations: list[Conversation],
    concurrency: int,
    warmup: list[BenchRequest],
    request_rate: float = math.inf,
) -> Run:
    """Start a fresh suite, warm it up, run the workload once and stop the suite."""
    with running_suite(spec, model_dir, log_dir / name) as suite:
        run = asyncio.run(_measure(name, spec, suite, conversations, concurrency, warmup, request_rate))
    s = run.summary
    log(
        f"{name}: {s.duration_s:.0f}s, mean TTFT {s.mean_ttft_ms:.0f} ms, {s.output_throughput:.1f} output tok/s, "
        f"hit rate {_percent(run.cache.hit_rate)}, requests per worker {_routed(run)}, other processes' CPU share "
        f"{_percent(run.other_cpu_share)}"
    )
    if run.other_cpu_share is not None and run.other_cpu_share > QUIET_SHARE:
        log(f"warning: other processes used {run.other_cpu_share:.0%} of the CPUs during {name}")
    return run


# ---------------------------------------------------------------------------------------------- report


def _percent(rate: float | None) -> str:
    return "n/a" if rate is None or math.isinf(rate) else f"{rate * 100:.1f}%"


def _routed(run: Run) -> str:
    return ", ".join(f"{w.worker_id} {w.num_routed}" for w in run.cache.workers) or "n/a"


def median_run(runs: Sequence[Run], metric: str) -> Run:
    """The run whose summary metric is the median (the lower middle one for an even count).

    Runs during which other processes took more than QUIET_SHARE of the CPUs are left out, unless all were.
    """
    quiet = [r for r in runs if r.other_cpu_share is None or r.other_cpu_share <= QUIET_SHARE]
    ordered = sorted(quiet or runs, key=lambda r: float(getattr(r.summary, metric)))
    return ordered[(len(ordered) - 1) // 2]


def ttft_ratios(kv: Run, round_robin: Run) -> dict[str, float]:
    """Round-robin TTFT / kv TTFT for the mean, the median and p99 (above 1: kv is faster)."""
    a, b = round_robin.summary, kv.summary
    return {
        "mean": ratio(a.mean_ttft_ms, b.mean_ttft_ms),
        "p50": ratio(a.median_ttft_ms, b.median_ttft_ms),
        "p99": ratio(a.p99_ttft_ms, b.p99_ttft_ms),
    }


def chat_table(kv: Run, round_robin: Run) -> str:
    """Part 1's table: both routings on the same conversations, and their TTFT ratio."""
    ratios = ttft_ratios(kv, round_robin)
    lines = [
        "| routing | mean TTFT ms | p50 TTFT ms | p99 TTFT ms | prefix-cache hit rate (scheduler) | cached prompt "
        "tokens (client) | requests per worker | output tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for run in (kv, round_robin):
        s = run.summary
        lines.append(
            f"| {run.spec.routing} | {s.mean_ttft_ms:.1f} | {s.median_ttft_ms:.1f} | {s.p99_ttft_ms:.1f} | "
            f"{_percent(run.cache.hit_rate)} | {_percent(run.client_hit_rate)} | {_routed(run)} | "
            f"{s.output_throughput:.2f} |"
        )
    verdict = "PASS" if ratios["mean"] >= TTFT_TARGET else "MISS"
    lines.append(
        f"| **round-robin / kv** | **{ratios['mean']:.2f}x** | {ratios['p50']:.2f}x | {ratios['p99']:.2f}x | "
        f"target >= {TTFT_TARGET:g}x: **{verdict}** | | | |"
    )
    return "\n".join(lines)


def throughput_table(one: Run, two: Run) -> str:
    """Part 2's table: the same mixed workload on 1 and 2 workers."""
    lines = [
        "| workers | threads per worker | routing | output tok/s | mean TTFT ms | mean TPOT ms | requests per worker |",
        "| ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for run in (one, two):
        s = run.summary
        lines.append(
            f"| {run.spec.num_workers} | {run.spec.worker_threads} | {run.spec.routing} | {s.output_throughput:.2f} | "
            f"{s.mean_ttft_ms:.1f} | {s.mean_tpot_ms:.1f} | {_routed(run)} |"
        )
    lines.append(f"| **2 / 1** | | | **{throughput_ratio(one, two):.2f}x** | | | |")
    return "\n".join(lines)


def throughput_ratio(one: Run, two: Run) -> float:
    """Output tok/s of 2 workers / 1 worker."""
    return ratio(two.summary.output_throughput, one.summary.output_throughput)


def by_turn_table(kv: Run, round_robin: Run) -> str:
    """Mean TTFT of each turn position under both routings."""
    turns = range(len(kv.mean_ttft_ms_by_turn))
    lines = [
        "| turn | " + " | ".join(str(k + 1) for k in turns) + " |",
        "| --- |" + " ---: |" * len(turns),
    ]
    for run in (kv, round_robin):
        cells = " | ".join("n/a" if m is None else f"{m:.0f}" for m in run.mean_ttft_ms_by_turn)
        lines.append(f"| {run.spec.routing} mean TTFT ms | {cells} |")
    return "\n".join(lines)


def describe_chat(plan: Plan) -> str:
    """One line for the table's caption."""
    opening = (
        "" if plan.first_turn_input is None else f"an opening turn of {_span(plan.first_turn_input)} tokens, then "
    )
    arrivals = (
        "all starting at once"
        if math.isinf(plan.chat_request_rate)
        else (f"starting at {plan.chat_request_rate:g} per second")
    )
    return (
        f"{plan.num_conversations} conversations x {plan.num_turns} turns, {opening}{_span(plan.turn_input)} new user "
        f"tokens and {_span(plan.turn_output)} output tokens per turn, at most {plan.chat_concurrency} at once, "
        f"{arrivals}"
    )


def _span(bounds: Range) -> str:
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}-{bounds[1]}"


# ---------------------------------------------------------------------------------------------- main


# The chat traces --chat-trace picks; FULL's own is `even`.
# Users arrive one every two seconds on average and chat for 10 turns, as a chat service sees them; with
# every conversation opening at once, the first turns' queue (the same under any routing) hides the rest.
DOCUMENT_CHAT = {"first_turn_input": (1000, 1400), "turn_input": (20, 60), "num_turns": 10, "chat_request_rate": 0.5}
QUICK_DOCUMENT_CHAT = {"first_turn_input": (256, 256), "turn_input": (16, 16), "chat_request_rate": 2.0}
CHAT_TRACES = ("document", "even")


def chat_plan(plan: Plan, trace: str, quick: bool) -> Plan:
    """The plan with the chosen chat trace's turn lengths."""
    if trace == "even":
        return plan
    return replace(plan, **(QUICK_DOCUMENT_CHAT if quick else DOCUMENT_CHAT))  # type: ignore[arg-type]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The script's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run of a few minutes")
    parser.add_argument(
        "--chat-trace", choices=CHAT_TRACES, default="document", help="the chat workload (see above; default document)"
    )
    parser.add_argument(
        "--out-dir", type=Path, default=ROOT / "docs" / "benchmarks", help="where routing-TRACE.json goes"
    )
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: embedded SmolLM2)")
    parser.add_argument("--log-dir", type=Path, default=None, help="service logs (default: a temporary directory)")
    parser.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count() or 1,
        help="cores the workers split: each of N workers gets cores/N torch threads (default: all)",
    )
    parser.add_argument(
        "--throughput-routing", default="kv", help="routing of the 2-worker throughput run (default kv)"
    )
    parser.add_argument("--kv-cache-memory", default=None, help="each worker's --kv-cache-memory (default: the plan's)")
    parser.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        help="a flag for every suite's scheduler, the same on both sides (repeatable; e.g. "
        "--scheduler-arg=--long-prefill-token-threshold --scheduler-arg=256)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs of each side, each on a fresh suite, the median reported (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="chat: kv against round-robin; throughput: 2 workers against 1 (default both)",
    )
    return parser.parse_args(argv)


def threads_per_worker(cores: int, num_workers: int) -> int:
    """Each worker's share of the cores, at least one thread."""
    return max(1, cores // num_workers)


def run_chat(ns: argparse.Namespace, plan: Plan, model_dir: Path, vocab: int, log_dir: Path) -> dict[str, Any]:
    """Part 1: the same conversations under kv, then round-robin routing, each on a fresh 2-worker suite."""
    chat = multi_turn_dataset(
        plan.num_conversations,
        plan.num_turns,
        plan.turn_input,
        plan.turn_output,
        vocab,
        SEED_CHAT,
        first_turn_input_len=plan.first_turn_input,
    )
    runs: dict[str, list[Run]] = {routing: [] for routing in ROUTING_MODES}
    for i in range(ns.repeat):
        # Alternating the routings spreads slow spells of a shared machine over both sides.
        for routing in ROUTING_MODES:
            spec = suite_spec(ns, plan, 2, routing)
            name = f"chat-{routing}-{i + 1}"
            runs[routing].append(
                measure(
                    name,
                    spec,
                    model_dir,
                    log_dir,
                    chat,
                    plan.chat_concurrency,
                    warmup_requests(vocab),
                    plan.chat_request_rate,
                )
            )
    kv, rr = (median_run(runs[routing], "mean_ttft_ms") for routing in ROUTING_MODES)
    ratios = ttft_ratios(kv, rr)
    print(f"\nchat: {describe_chat(plan)}\n\n{chat_table(kv, rr)}\n\n{by_turn_table(kv, rr)}")
    return {
        "workload": describe_chat(plan),
        "ttft_ratio_round_robin_over_kv": ratios,
        "ttft_target": TTFT_TARGET,
        "ttft_target_met": ratios["mean"] >= TTFT_TARGET,
        "reported": [kv.name, rr.name],
        "mean_ttft_ms_of_runs": {r: [run.summary.mean_ttft_ms for run in runs[r]] for r in ROUTING_MODES},
        "runs": [run.to_dict() for r in ROUTING_MODES for run in runs[r]],
    }


def run_throughput(ns: argparse.Namespace, plan: Plan, model_dir: Path, vocab: int, log_dir: Path) -> dict[str, Any]:
    """Part 2: one mixed random workload on 2 workers, then on 1."""
    mixed = single_turns(random_dataset(plan.mixed_prompts, plan.mixed_input, plan.mixed_output, vocab, SEED_MIXED))
    runs: dict[int, list[Run]] = {2: [], 1: []}
    for i in range(ns.repeat):
        for n in runs:
            spec = suite_spec(ns, plan, n, ns.throughput_routing)
            name = f"mixed-{n}-workers-{i + 1}"
            runs[n].append(
                measure(name, spec, model_dir, log_dir, mixed, plan.mixed_concurrency, warmup_requests(vocab))
            )
    two, one = (median_run(runs[n], "output_throughput") for n in (2, 1))
    print(f"\nmixed: {describe(mixed, plan.mixed_concurrency)}\n\n{throughput_table(one, two)}")
    return {
        "workload": describe(mixed, plan.mixed_concurrency),
        "output_throughput_ratio_2_over_1_workers": throughput_ratio(one, two),
        "reported": [two.name, one.name],
        "output_tok_s_of_runs": {f"{n}_workers": [run.summary.output_throughput for run in runs[n]] for n in runs},
        "runs": [run.to_dict() for n in runs for run in runs[n]],
    }


def suite_spec(ns: argparse.Namespace, plan: Plan, num_workers: int, routing: str) -> SuiteSpec:
    """The suite of one run: the plan's KV cache, the cores split between the workers."""
    threads = threads_per_worker(ns.cores, num_workers)
    return SuiteSpec(
        num_workers,
        routing,
        threads,
        ns.kv_cache_memory or plan.kv_cache_memory,
        plan.max_model_len,
        scheduler_args=tuple(ns.scheduler_arg),
    )


def warmup_requests(vocab: int) -> list[BenchRequest]:
    """Four short requests sent at once, so that every worker gets some whatever the routing."""
    return random_dataset(4, (16, 16), (2, 2), vocab, SEED_WARMUP)


def describe(conversations: Sequence[Conversation], concurrency: int) -> str:
    """A one-line description of a single-turn workload."""
    prompts = [len(c[0].prompt_token_ids) for c in conversations]
    outputs = [c[0].output_len for c in conversations]
    return (
        f"{len(conversations)} requests, input {min(prompts)}-{max(prompts)}, output {min(outputs)}-{max(outputs)}, "
        f"{concurrency} at once"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the parts; 0 when every run completed (whether the target was met or not)."""
    ns = parse_args(argv)
    if ns.repeat is None:
        ns.repeat = 1 if ns.quick else 3
    if ns.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    check_routing_support({*ROUTING_MODES, ns.throughput_routing})
    from services.common.logs import configure_logging
    from services.worker.model_fetch import ensure_embedded_model

    configure_logging("bench-routing", "warning")
    began = time.perf_counter()
    plan = chat_plan(QUICK if ns.quick else FULL, ns.chat_trace, ns.quick)
    model_dir: Path = ns.model.expanduser() if ns.model else ensure_embedded_model()
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="meshserve-bench-routing-"))
    log(f"{'quick' if ns.quick else 'full'} plan, parts {' '.join(ns.parts)}, logs in {log_dir}")
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(ROOT),
        "model": str(model_dir),
        "plan": "quick" if ns.quick else "full",
        "chat_trace": ns.chat_trace,
        "plan_sizes": asdict(plan),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
    }
    if "chat" in ns.parts:
        results["chat"] = run_chat(ns, plan, model_dir, vocab, log_dir)
    if "throughput" in ns.parts:
        results["throughput"] = run_throughput(ns, plan, model_dir, vocab, log_dir)
    results["wall_seconds"] = round(time.perf_counter() - began, 1)
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    path = ns.out_dir / f"routing-{ns.chat_trace}{'-quick' if ns.quick else ''}.json"
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    print(f"\nresults in {path}; wall time {results['wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
