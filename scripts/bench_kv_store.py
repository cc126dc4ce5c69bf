"""Measure issue 12's kvstore targets through `meshserve bench`'s runner, against fresh suites of real processes.

1. Shared prefix on a worker that has never seen it: 2 workers under `--routing round-robin`; each of N
   2,000-token prefixes is sent first with one suffix (worker-0 computes it, and with the store saves its
   blocks), then, once the store holds them, with another suffix (worker-1, which never saw the prefix).
   Reported: worker-1's mean TTFT with the kvstore on (it loads the prefix) against off (it recomputes it);
   target >= 3x lower.
2. The multi-turn document chat of issue 11 (scripts/bench_routing.py's `document` trace) across 2 workers
   with `--routing kv`, kvstore on against off.
3. The store's own Put/Get throughput through gRPC (scripts/bench_kvstore.py), memory and Redis backends,
   against this machine's copy bandwidth.

Writes docs/benchmarks/kv-store.json and prints markdown tables for docs/benchmarks.md.

    python scripts/bench_kv_store.py           # about 10 minutes on 2 quiet cores
    python scripts/bench_kv_store.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_routing import (
    DOCUMENT_CHAT,
    FULL,
    SEED_CHAT,
    SEED_WARMUP,
    Run,
    Suite,
    SuiteSpec,
    log,
    measure,
    ratio,
    running_suite,
    wait_until_quiet,
)

from services.client.bench.cache_stats import fetch_stats, stats_delta
from services.client.bench.datasets import BenchRequest, multi_turn_dataset, random_dataset
from services.client.bench.provenance import cpu_model, git_commit
from services.client.bench.runner import run_benchmark
from services.common.channels import insecure_channel
from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
TTFT_TARGET = 3.0
VOCAB = 49152  # SmolLM2's; random ids below it


@dataclass(frozen=True)
class Plan:
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    output_len: int
    chat_conversations: int
    chat_turns: int
    kv_cache_memory: str
    max_model_len: int


FULL_PLAN = Plan(6, 2000, 32, 16, 8, 10, "1GiB", 4096)
QUICK_PLAN = Plan(2, 512, 16, 4, 3, 3, "256MiB", 2048)


def _spec(plan: Plan, kv_store: bool, routing: str) -> SuiteSpec:
    return SuiteSpec(
        num_workers=2,
        routing=routing,
        worker_threads=1,
        kv_cache_memory=plan.kv_cache_memory,
        max_model_len=plan.max_model_len,
        kv_store=kv_store,
    )


async def _store_blocks(address: str | None) -> int:
    if address is None:
        return 0
    async with insecure_channel(address) as channel:
        stats = await kvstore_pb2_grpc.KVBlockStoreStub(channel).Stats(kvstore_pb2.StatsRequest(), timeout=10)
        return int(stats.blocks_stored)


async def _prefix_run(suite: Suite, plan: Plan) -> dict[str, Any]:
    rng = random.Random(5)
    warmup = random_dataset(2, (16, 16), (2, 2), VOCAB, seed=SEED_WARMUP)
    await run_benchmark(suite.address, warmup, progress=False)  # one per worker: first steps untimed
    await wait_until_quiet([])
    before = await fetch_stats(suite.scheduler_address)
    second_ttfts: list[float] = []
    first_ttfts: list[float] = []
    for _ in range(plan.num_prefixes):
        prefix = [rng.randrange(10, VOCAB) for _ in range(plan.prefix_len)]
        first = BenchRequest([*prefix, *(rng.randrange(10, VOCAB) for _ in range(plan.suffix_len))], plan.output_len)
        second = BenchRequest([*prefix, *(rng.randrange(10, VOCAB) for _ in range(plan.suffix_len))], plan.output_len)
        stored = await _store_blocks(suite.kv_store_address)
        records, _ = await run_benchmark(suite.address, [first], progress=False)
        first_ttfts.append(records[0].ttft)
        if suite.kv_store_address is not None:
            # The second request is about the store, not about racing the first one's saves.
            deadline = time.monotonic() + 60
            while await _store_blocks(suite.kv_store_address) < stored + plan.prefix_len // 16:
                if time.monotonic() > deadline:
                    raise RuntimeError("the first request's blocks never reached the store")
                await asyncio.sleep(0.05)
        records, _ = await run_benchmark(suite.address, [second], progress=False)
        if not records[0].success:
            raise RuntimeError(f"request failed: {records[0].error}")
        second_ttfts.append(records[0].ttft)
    delta = stats_delta(before, await fetch_stats(suite.scheduler_address))
    return {
        "first_ttft_ms": [t * 1000 for t in first_ttfts],
        "second_ttft_ms": [t * 1000 for t in second_ttfts],
        "mean_second_ttft_ms": 1000 * sum(second_ttfts) / len(second_ttfts),
        "requests_per_worker": {w.worker_id: w.num_routed for w in delta.workers},
        "scheduler_stats": delta.to_dict(),
    }


def prefix_part(plan: Plan, model_dir: Path, log_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv_store in (True, False):
        name = "store-on" if kv_store else "store-off"
        with running_suite(_spec(plan, kv_store, "round-robin"), model_dir, log_dir / f"prefix-{name}") as suite:
            out[name] = asyncio.run(_prefix_run(suite, plan))
        log(f"prefix {name}: worker-1 mean TTFT {out[name]['mean_second_ttft_ms']:.0f} ms")
    on, off = out["store-on"]["mean_second_ttft_ms"], out["store-off"]["mean_second_ttft_ms"]
    out["ttft_ratio_off_over_on"] = ratio(off, on)
    out["ttft_target"] = TTFT_TARGET
    out["ttft_target_met"] = out["ttft_ratio_off_over_on"] >= TTFT_TARGET
    return out


def chat_part(plan: Plan, model_dir: Path, log_dir: Path, routings: Sequence[str]) -> dict[str, Any]:
    chat = replace(FULL, **DOCUMENT_CHAT)  # type: ignore[arg-type]
    chat = replace(chat, num_conversations=plan.chat_conversations, num_turns=plan.chat_turns)
    conversations = multi_turn_dataset(
        chat.num_conversations, chat.num_turns, chat.turn_input, chat.turn_output, VOCAB, seed=SEED_CHAT,
        first_turn_input_len=chat.first_turn_input,
    )  # fmt: skip
    warmup = random_dataset(4, (16, 16), (2, 2), VOCAB, seed=SEED_WARMUP)
    out: dict[str, Any] = {"runs": []}
    for routing in routings:
        runs: dict[bool, Run] = {}
        for kv_store in (True, False):
            name = f"chat-{routing}-store-{'on' if kv_store else 'off'}"
            runs[kv_store] = measure(
                name, _spec(plan, kv_store, routing), model_dir, log_dir, conversations, chat.chat_concurrency,
                warmup, chat.chat_request_rate,
            )  # fmt: skip
            out["runs"].append(runs[kv_store].to_dict())
        on, off = runs[True].summary, runs[False].summary
        out[routing] = {
            "ttft_ratio_off_over_on": ratio(off.mean_ttft_ms, on.mean_ttft_ms),
            "output_throughput_on_over_off": ratio(on.output_throughput, off.output_throughput),
        }
    return out


def throughput_part(quick: bool) -> dict[str, Any]:
    out = ROOT / "docs" / "benchmarks" / "kvstore-throughput.json"
    args = [sys.executable, str(ROOT / "scripts" / "bench_kvstore.py")] + (["--quick"] if quick else [])
    subprocess.run(args, check=True, cwd=ROOT)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="prefix,chat,throughput")
    parser.add_argument(
        "--chat-routing", default="kv,round-robin", help="routings the chat part compares the store on and off under"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "kv-store.json")
    ns = parser.parse_args()
    from services.worker.model_fetch import ensure_embedded_model

    plan = QUICK_PLAN if ns.quick else FULL_PLAN
    model_dir = ensure_embedded_model()
    parts = ns.parts.split(",")
    started = time.perf_counter()
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(ROOT),
        "cpu_model": cpu_model(),
        "model": str(model_dir),
        "plan": asdict(plan),
    }
    with tempfile.TemporaryDirectory(prefix="bench-kv-store-") as tmp:
        if "prefix" in parts:
            result["prefix"] = prefix_part(plan, model_dir, Path(tmp))
        if "chat" in parts:
            result["chat"] = chat_part(plan, model_dir, Path(tmp), ns.chat_routing.split(","))
    if "throughput" in parts:
        result["throughput"] = throughput_part(ns.quick)
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k in ("prefix", "chat")}, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
