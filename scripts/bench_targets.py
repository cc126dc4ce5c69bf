"""Measure issue 3's performance targets side by side in one run: meshserve vs its baselines.

Starts the suite (scheduler, one worker, gateway) on free loopback ports, runs every target, stops it,
then runs the in-process baselines on the very same workloads. Writes results.json and
throughput_vs_concurrency.png into --out-dir and prints a markdown table for docs/benchmarks.md.

    python scripts/bench_targets.py                 # default sizes, bf16 (~35 min on 2 cores)
    python scripts/bench_targets.py --quick --dtype float32   # smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.client.bench.datasets import BenchRequest, random_dataset, shared_prefix_dataset
from services.client.bench.metrics import BenchSummary, summarize
from services.client.bench.provenance import git_commit
from services.client.bench.records import RequestRecord
from services.client.launcher import Launcher, start_suite_processes, wait_all_healthy
from services.common.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("a", "b", "c", "d", "e")
STARTUP_TIMEOUT_S = 600.0
KV_CACHE_MEMORY = "4GiB"
SCHEDULER_MAX_NUM_SEQS = 64
# Seeds differ per workload so no prompt of one target is a prefix-cache hit for another.
SEED_MIXED, SEED_STEADY, SEED_SINGLE, SEED_PREFIX, SEED_SWEEP, SEED_WARMUP = 1, 2, 3, 4, 5, 7

Range = tuple[int, int]


@dataclass(frozen=True)
class Plan:
    """Workload sizes of every target: FULL (default) is what docs/benchmarks.md reports, QUICK a smoke run."""

    mixed_prompts: int
    mixed_input: Range
    mixed_output: Range
    mixed_concurrency: int
    steady_prompts: int
    steady_input: int
    steady_output: int
    single_prompts: int
    single_input: Range
    single_output: int
    prefix_prompts: int
    prefix_len: int
    prefix_suffix: Range
    prefix_output: int
    prefix_concurrency: int
    sweep_concurrency: tuple[int, ...]
    # Sweep requests per point: this many rounds of the concurrency, at least sweep_min_prompts.
    sweep_prompts_per_concurrency: int
    sweep_min_prompts: int
    sweep_input: Range
    sweep_output: Range


# The issue's workloads as written: about an hour at bf16 on the 2-core reference machine.
ISSUE = Plan(
    mixed_prompts=64,
    mixed_input=(32, 512),
    mixed_output=(16, 256),
    mixed_concurrency=32,
    steady_prompts=32,
    steady_input=64,
    steady_output=128,
    single_prompts=4,
    single_input=(64, 128),
    single_output=64,
    prefix_prompts=16,
    prefix_len=1000,
    prefix_suffix=(16, 64),
    prefix_output=16,
    prefix_concurrency=4,
    sweep_concurrency=(1, 4, 16, 32, 64),
    sweep_prompts_per_concurrency=2,
    sweep_min_prompts=8,
    sweep_input=(32, 256),
    sweep_output=(32, 128),
)

# The default: targets a-d exactly as the issue states them, and a lighter sweep (one round per point,
# shorter requests: the issue fixes only its concurrency levels), to fit ~40 minutes at bf16.
FULL = replace(
    ISSUE,
    sweep_prompts_per_concurrency=1,
    sweep_input=(32, 128),
    sweep_output=(32, 96),
)

QUICK = Plan(
    mixed_prompts=8,
    mixed_input=(16, 64),
    mixed_output=(4, 32),
    mixed_concurrency=4,
    steady_prompts=4,
    steady_input=32,
    steady_output=16,
    single_prompts=2,
    single_input=(16, 32),
    single_output=8,
    prefix_prompts=4,
    prefix_len=256,
    prefix_suffix=(8, 16),
    prefix_output=4,
    prefix_concurrency=2,
    sweep_concurrency=(1, 2, 4),
    sweep_prompts_per_concurrency=2,
    sweep_min_prompts=2,
    sweep_input=(16, 64),
    sweep_output=(8, 16),
)


def sweep_prompts(plan: Plan, concurrency: int) -> int:
    """Requests per sweep point."""
    return max(plan.sweep_prompts_per_concurrency * concurrency, plan.sweep_min_prompts)


@dataclass
class Workloads:
    """Every target's requests, built once so meshserve and its baselines see identical ones."""

    mixed: list[BenchRequest]
    steady: list[BenchRequest]
    single: list[BenchRequest]
    # The last prefix request is the warm-up: same prefix, its own suffix, never timed.
    prefix: list[BenchRequest]
    sweep: dict[int, list[BenchRequest]]
    warmup: list[BenchRequest]


def build_workloads(plan: Plan, vocab_size: int) -> Workloads:
    """Deterministic workloads for the plan."""
    return Workloads(
        mixed=random_dataset(plan.mixed_prompts, plan.mixed_input, plan.mixed_output, vocab_size, SEED_MIXED),
        steady=random_dataset(
            plan.steady_prompts,
            (plan.steady_input, plan.steady_input),
            (plan.steady_output, plan.steady_output),
            vocab_size,
            SEED_STEADY,
        ),
        single=random_dataset(
            plan.single_prompts, plan.single_input, (plan.single_output, plan.single_output), vocab_size, SEED_SINGLE
        ),
        prefix=shared_prefix_dataset(
            plan.prefix_prompts + 1,
            plan.prefix_len,
            plan.prefix_suffix,
            (plan.prefix_output, plan.prefix_output),
            vocab_size,
            SEED_PREFIX,
        ),
        # Its own prompts per point (one seed each), so no point hits the prefix cache filled by an earlier one.
        sweep={
            c: random_dataset(
                sweep_prompts(plan, c), plan.sweep_input, plan.sweep_output, vocab_size, SEED_SWEEP * 1000 + c
            )
            for c in plan.sweep_concurrency
        },
        warmup=random_dataset(1, (16, 16), (2, 2), vocab_size, SEED_WARMUP),
    )


# ---------------------------------------------------------------------------------------------- suite


class Suite:
    """A running scheduler + one worker + gateway; stop() ends them."""

    def __init__(self, model_dir: Path, dtype: str, log_dir: Path, *, prefix_caching: bool) -> None:
        self.launcher = Launcher(log_dir, env={"MESHSERVE_LOG_LEVEL": "warning", "MESHSERVE_LOG_FORMAT": "json"})
        scheduler_args = ["--max-num-seqs", str(SCHEDULER_MAX_NUM_SEQS)]
        if not prefix_caching:
            scheduler_args.append("--no-enable-prefix-caching")
        try:
            procs = start_suite_processes(
                self.launcher,
                model=str(model_dir),
                host="127.0.0.1",
                scheduler_port=free_port(),
                worker_ports=[free_port()],
                gateway_port=free_port(),
                scheduler_args=scheduler_args,
                worker_args=["--dtype", dtype, "--kv-cache-memory", KV_CACHE_MEMORY],
            )
            asyncio.run(wait_all_healthy(self.launcher, procs.all, STARTUP_TIMEOUT_S))
        except BaseException:
            self.launcher.stop_all(timeout=10)
            raise
        self.address = procs.gateway.address

    def stop(self) -> None:
        """SIGTERM everything, gateway first."""
        self.launcher.stop_all(timeout=30)


@contextmanager
def running_suite(model_dir: Path, dtype: str, log_dir: Path, *, prefix_caching: bool) -> Iterator[Suite]:
    """A suite for the duration of the with-block."""
    started = time.perf_counter()
    suite = Suite(model_dir, dtype, log_dir, prefix_caching=prefix_caching)
    log(f"suite up (prefix caching {'on' if prefix_caching else 'off'}) in {time.perf_counter() - started:.0f}s")
    try:
        yield suite
    finally:
        suite.stop()


def serve(
    address: str,
    requests: list[BenchRequest],
    concurrency: int,
    warmup: Sequence[BenchRequest],
    *,
    backend: str = "meshserve",
) -> BenchSummary:
    """Warm up with requests outside the workload, then run the workload through the gateway."""
    from services.client.bench.runner import run_benchmark

    async def go() -> tuple[list[RequestRecord], float]:
        warm, _ = await run_benchmark(address, list(warmup), max_concurrency=concurrency, progress=False)
        if failed := [r.error for r in warm if not r.success]:
            raise RuntimeError(f"warm-up failed: {failed[0]}")
        return await run_benchmark(address, requests, max_concurrency=concurrency, progress=False)

    records, duration = asyncio.run(go())
    return checked(summarize(records, duration, backend=backend, max_concurrency=concurrency))


def checked(summary: BenchSummary) -> BenchSummary:
    """A summary whose requests all completed with exactly the tokens they asked for; else RuntimeError."""
    if summary.failed or summary.output_len_mismatches:
        raise RuntimeError(
            f"{summary.backend}: {summary.failed} failed, {summary.output_len_mismatches} with a wrong token "
            f"count; errors: {summary.errors}"
        )
    return summary


def in_process(
    backend: str,
    fn: Callable[..., tuple[list[RequestRecord], float]],
    model_dir: Path,
    requests: list[BenchRequest],
    batch_size: int,
    dtype: str,
) -> BenchSummary:
    """One in-process baseline run, summarized like a served one."""
    records, duration = fn(model_dir, requests, batch_size, dtype, sys.stderr.isatty())
    return checked(summarize(records, duration, backend=backend, max_concurrency=batch_size))


# ---------------------------------------------------------------------------------------------- report


# The metric each repeated target compares; its median run is the one reported.
REPEATED_METRICS = {"a": "output_throughput", "b": "output_throughput", "c": "mean_tpot_ms"}


def median_run(runs: Sequence[BenchSummary], metric: str) -> BenchSummary:
    """The run whose metric is the median (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: float(getattr(r, metric)))
    return ordered[(len(ordered) - 1) // 2]


def log(message: str) -> None:
    """Progress on stderr, with a timestamp, so stdout carries only the results."""
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Verdict:
    """One target's outcome."""

    target: str
    name: str
    workload: str
    metric: str
    meshserve: float
    baseline_name: str
    baseline: float
    ratio: float
    threshold: float
    ratio_means: str
    # Every run's metric on each side, when the target was repeated (the median one is reported).
    meshserve_runs: list[float] = field(default_factory=list)
    baseline_runs: list[float] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.ratio >= self.threshold

    def line(self) -> str:
        return (
            f"{self.target}. {self.name}: meshserve {self.meshserve:.2f} vs {self.baseline_name} {self.baseline:.2f} "
            f"{self.metric}; {self.ratio_means} = {self.ratio:.2f}x (target >= {self.threshold:g}x) "
            f"{'PASS' if self.passed else 'MISS'}"
            + (
                f"; medians of runs {_runs(self.meshserve_runs)} and {_runs(self.baseline_runs)}"
                if len(self.meshserve_runs) > 1
                else ""
            )
        )


def _runs(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


@dataclass
class SweepPoint:
    """Both backends at one concurrency (batch size for transformers)."""

    concurrency: int
    num_prompts: int
    meshserve: BenchSummary
    transformers: BenchSummary

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "num_prompts": self.num_prompts,
            "meshserve_output_tok_s": self.meshserve.output_throughput,
            "transformers_output_tok_s": self.transformers.output_throughput,
            "ratio": ratio(self.meshserve.output_throughput, self.transformers.output_throughput),
            "meshserve_summary": self.meshserve.to_dict(),
            "transformers_summary": self.transformers.to_dict(),
        }


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, inf when the denominator is 0."""
    return numerator / denominator if denominator > 0 else math.inf


def markdown_table(verdicts: list[Verdict], sweep: list[SweepPoint]) -> str:
    """The results section's tables."""
    lines = [
        "| target | workload | metric | meshserve | baseline | ratio | target | result |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for v in verdicts:
        lines.append(
            f"| {v.target}. {v.name} | {v.workload} | {v.metric} | {v.meshserve:.2f} | "
            f"{v.baseline:.2f} ({v.baseline_name}) | {v.ratio:.2f}x | >= {v.threshold:g}x | "
            f"{'PASS' if v.passed else 'MISS'} |"
        )
    if sweep:
        lines += [
            "",
            "| concurrency | requests | meshserve output tok/s | transformers output tok/s | ratio |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in sweep:
            ms, tf = p.meshserve.output_throughput, p.transformers.output_throughput
            lines.append(f"| {p.concurrency} | {p.num_prompts} | {ms:.2f} | {tf:.2f} | {ratio(ms, tf):.2f}x |")
    return "\n".join(lines)


def plot_sweep(sweep: list[SweepPoint], path: Path, title: str) -> None:
    """Output tokens/s against concurrency, one line per backend, log2 x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p.concurrency for p in sweep]
    ax.plot(xs, [p.meshserve.output_throughput for p in sweep], marker="o", label="meshserve (gRPC suite)")
    ax.plot(
        xs, [p.transformers.output_throughput for p in sweep], marker="s", label="transformers generate, static batches"
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrency (requests in flight / batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    cpu_model, flags = platform.processor() or "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu_model in ("unknown", "", "x86_64"):
                cpu_model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    mem_gib = None
    with suppress(ValueError, OSError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "memory_gib": mem_gib,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def describe(requests: Sequence[BenchRequest], concurrency: int) -> str:
    """A one-line workload description for the table."""
    prompts = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.output_len for r in requests]

    def span(values: list[int]) -> str:
        return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"

    return f"{len(requests)} req, in {span(prompts)}, out {span(outputs)}, conc {concurrency}"


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The script's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="every backend's dtype")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run of a few minutes")
    sizes.add_argument(
        "--issue-sizes", action="store_true", help="the issue's workloads unshrunk (about an hour at bf16)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs of targets a-c on each side, the median reported (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--transformers-repeat",
        type=int,
        default=None,
        help="runs of the transformers baselines of a and c (default: --repeat); where the host has no native "
        "bf16, one bf16 run of a takes over ten minutes",
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "benchmarks", help="results.json and the plot")
    parser.add_argument("--skip", nargs="*", choices=TARGETS, default=[], help="targets not to run (a b c d e)")
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: embedded SmolLM2)")
    parser.add_argument("--log-dir", type=Path, default=None, help="service logs (default: a temporary directory)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the targets; 0 when every one ran (whether it met its target or not)."""
    ns = parse_args(argv)
    if ns.repeat is None:
        ns.repeat = 1 if ns.quick else 3
    if ns.transformers_repeat is None:
        ns.transformers_repeat = ns.repeat
    if ns.repeat < 1 or ns.transformers_repeat < 1:
        raise SystemExit("--repeat and --transformers-repeat must be >= 1")
    from services.common.logs import configure_logging

    # The in-process backends log model loads; stdout is for the results only.
    configure_logging("bench-targets", "warning")
    from services.worker.benchmarks.raw_runner import run_raw_runner
    from services.worker.benchmarks.transformers_baseline import run_transformers_baseline
    from services.worker.model_fetch import ensure_embedded_model

    began = time.perf_counter()
    model_dir: Path = ns.model.expanduser() if ns.model else ensure_embedded_model()
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    plan_name = "quick" if ns.quick else "issue" if ns.issue_sizes else "full"
    plan = {"quick": QUICK, "issue": ISSUE, "full": FULL}[plan_name]
    wl = build_workloads(plan, vocab_size)
    run = [t for t in TARGETS if t not in ns.skip]
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="meshserve-bench-"))
    log(f"targets {' '.join(run)}, dtype {ns.dtype}, {plan_name} plan, logs in {log_dir}")
    served: dict[str, BenchSummary] = {}
    baseline: dict[str, BenchSummary] = {}
    served_runs: dict[str, list[BenchSummary]] = {}
    baseline_runs: dict[str, list[BenchSummary]] = {}
    sweep_served: dict[int, BenchSummary] = {}

    def repeat(measure: Callable[[], BenchSummary], times: int = ns.repeat) -> list[BenchSummary]:
        return [measure() for _ in range(times)]

    sweep_baseline: dict[int, BenchSummary] = {}
    timings: dict[str, float] = {}

    @contextmanager
    def phase(name: str) -> Iterator[None]:
        started = time.perf_counter()
        log(f"{name} ...")
        yield
        timings[name] = round(time.perf_counter() - started, 1)
        log(f"{name} done in {timings[name]:.0f}s")

    # 1. meshserve, default configuration (prefix caching on); seeds keep the workloads disjoint.
    if run:
        with running_suite(model_dir, ns.dtype, log_dir / "suite-caching", prefix_caching=True) as suite:
            if "a" in run:
                with phase("a meshserve"):
                    served_runs["a"] = repeat(lambda: serve(suite.address, wl.mixed, plan.mixed_concurrency, wl.warmup))
            if "b" in run:
                with phase("b meshserve"):
                    served_runs["b"] = repeat(lambda: serve(suite.address, wl.steady, plan.steady_prompts, wl.warmup))
            if "c" in run:
                with phase("c meshserve"):
                    served_runs["c"] = repeat(lambda: serve(suite.address, wl.single, 1, wl.warmup))
            if "d" in run:
                with phase("d meshserve, prefix caching on"):
                    served["d"] = serve(suite.address, wl.prefix[:-1], plan.prefix_concurrency, wl.prefix[-1:])
            if "e" in run:
                for c in plan.sweep_concurrency:
                    with phase(f"e meshserve concurrency {c}"):
                        sweep_served[c] = serve(suite.address, wl.sweep[c], c, wl.warmup)
    # 2. The other half of d: the same requests with prefix caching off.
    if "d" in run:
        with (
            running_suite(model_dir, ns.dtype, log_dir / "suite-no-caching", prefix_caching=False) as suite,
            phase("d meshserve, prefix caching off"),
        ):
            baseline["d"] = serve(
                suite.address,
                wl.prefix[:-1],
                plan.prefix_concurrency,
                wl.prefix[-1:],
                backend="meshserve-no-prefix-caching",
            )
    # 3. In-process baselines, with the suite stopped so they have the CPU to themselves.
    if "a" in run:
        with phase("a transformers"):
            baseline_runs["a"] = repeat(
                lambda: in_process(
                    "transformers", run_transformers_baseline, model_dir, wl.mixed, plan.mixed_concurrency, ns.dtype
                ),
                ns.transformers_repeat,
            )
    if "b" in run:
        with phase("b raw runner"):
            baseline_runs["b"] = repeat(
                lambda: in_process("raw-runner", run_raw_runner, model_dir, wl.steady, plan.steady_prompts, ns.dtype)
            )
    if "c" in run:
        with phase("c transformers"):
            baseline_runs["c"] = repeat(
                lambda: in_process("transformers", run_transformers_baseline, model_dir, wl.single, 1, ns.dtype),
                ns.transformers_repeat,
            )
    # Targets a-c report the median of their repeated runs on each side (the machine is noisy).
    for target, metric in REPEATED_METRICS.items():
        if target in served_runs:
            served[target] = median_run(served_runs[target], metric)
            baseline[target] = median_run(baseline_runs[target], metric)

    def runs(target: str) -> dict[str, list[float]]:
        metric = REPEATED_METRICS[target]
        return {
            "meshserve_runs": [getattr(r, metric) for r in served_runs[target]],
            "baseline_runs": [getattr(r, metric) for r in baseline_runs[target]],
        }

    if "e" in run:
        for c in plan.sweep_concurrency:
            with phase(f"e transformers batch {c}"):
                sweep_baseline[c] = in_process(
                    "transformers", run_transformers_baseline, model_dir, wl.sweep[c], c, ns.dtype
                )

    verdicts: list[Verdict] = []
    if "a" in run:
        ms, tf = served["a"].output_throughput, baseline["a"].output_throughput
        verdicts.append(
            Verdict(
                target="a",
                name="mixed workload",
                workload=describe(wl.mixed, plan.mixed_concurrency),
                metric="output tok/s",
                meshserve=ms,
                baseline_name="transformers",
                baseline=tf,
                ratio=ratio(ms, tf),
                threshold=4.0,
                ratio_means="meshserve / transformers",
                **runs("a"),
            )
        )
    if "b" in run:
        ms, raw = served["b"].output_throughput, baseline["b"].output_throughput
        verdicts.append(
            Verdict(
                target="b",
                name="steady decode",
                workload=describe(wl.steady, plan.steady_prompts),
                metric="output tok/s",
                meshserve=ms,
                baseline_name="raw runner",
                baseline=raw,
                ratio=ratio(ms, raw),
                threshold=0.9,
                ratio_means="meshserve / raw runner",
                **runs("b"),
            )
        )
    if "c" in run:
        ms, tf = served["c"].mean_tpot_ms, baseline["c"].mean_tpot_ms
        verdicts.append(
            Verdict(
                target="c",
                name="concurrency 1",
                workload=describe(wl.single, 1),
                metric="mean TPOT ms",
                meshserve=ms,
                baseline_name="transformers",
                baseline=tf,
                ratio=ratio(tf, ms),
                threshold=1.0,
                ratio_means="transformers TPOT / meshserve TPOT",
                **runs("c"),
            )
        )
    if "d" in run:
        on, off = served["d"].mean_ttft_ms, baseline["d"].mean_ttft_ms
        verdicts.append(
            Verdict(
                target="d",
                name="shared prefix",
                workload=describe(wl.prefix[:-1], plan.prefix_concurrency),
                metric="mean TTFT ms",
                meshserve=on,
                baseline_name="caching off",
                baseline=off,
                ratio=ratio(off, on),
                threshold=5.0,
                ratio_means="TTFT off / TTFT on",
            )
        )
    sweep = [
        SweepPoint(c, len(wl.sweep[c]), sweep_served[c], sweep_baseline[c])
        for c in plan.sweep_concurrency
        if "e" in run
    ]

    ns.out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(ROOT),
        "model": str(model_dir),
        "dtype": ns.dtype,
        "plan": plan_name,
        "plan_sizes": asdict(plan),
        "machine": machine_info(),
        "wall_seconds": round(time.perf_counter() - began, 1),
        "phase_seconds": timings,
        "targets": {
            v.target: {
                "name": v.name,
                "workload": v.workload,
                "metric": v.metric,
                "meshserve": v.meshserve,
                "baseline": v.baseline,
                "baseline_name": v.baseline_name,
                "ratio": v.ratio,
                "ratio_means": v.ratio_means,
                "threshold": v.threshold,
                "passed": v.passed,
                "meshserve_runs": v.meshserve_runs,
                "baseline_runs": v.baseline_runs,
                "meshserve_summary": served[v.target].to_dict(),
                "baseline_summary": baseline[v.target].to_dict(),
            }
            for v in verdicts
        },
        "sweep": [p.to_dict() for p in sweep],
    }
    results_path = ns.out_dir / "results.json"
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    if sweep:
        plot_sweep(
            sweep,
            ns.out_dir / "throughput_vs_concurrency.png",
            f"{model_dir.name}, {ns.dtype}, {results['machine']['cpus']} CPUs",
        )

    print()
    for v in verdicts:
        print(v.line())
    print()
    print(markdown_table(verdicts, sweep))
    print()
    print(f"results in {results_path}; wall time {results['wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
