"""What the worker's kvstore saves cost in CPU: bytes through gRPC, with and without the save thread's
linger (SAVE_LINGER_S), and handed over in shared memory (the worker's outbox, PutChunk.shared).

A real `meshserve kvstore` process (memory backend) on loopback and the worker's own KVTransfer over a
SmolLM2-135M-shaped bf16 cache (3 KV heads, 30 layers, 16-token blocks: 368,640 bytes a block). Saves
arrive as decode steps make them: --per-step blocks every --step-interval seconds. Reported: CPU seconds
of this process (the worker's side: gather, framing, gRPC; its OpenMP threads' spinning after each
gather counts too) and of the store process, for the same blocks, per configuration: bytes with the
linger off (every step its own Put: the baseline), bytes with --linger, and shared memory with the
linger off (the default); then each one's ratio to the baseline.

    python scripts/kv_save_cost.py             # about two minutes
    python scripts/kv_save_cost.py --blocks 200

A script a person runs, not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.client.bench.cpu_ticks import process_ticks, ticks_per_second  # noqa: E402
from services.client.launcher import Launcher  # noqa: E402
from services.common.proto.meshserve.v1 import worker_pb2  # noqa: E402
from services.worker.kv_blocks import SliceGeometry  # noqa: E402
from services.worker.kv_cache import KVCache  # noqa: E402
from services.worker.kv_transfer import KVTransfer  # noqa: E402
from services.worker.layers.attention import HND  # noqa: E402
from services.worker.platforms.cpu import CpuPlatform  # noqa: E402
from tests.support.kvstore import start_kvstore  # noqa: E402

GEOMETRY = SliceGeometry(
    num_kv_heads=3, num_layers=30, block_size=16, head_dim=64, dtype=torch.bfloat16, head_start=0, head_count=3
)
CACHE_BLOCKS = 64
WAIT_S = 120.0


def cpu_seconds(pid: int) -> float:
    return process_ticks(pid) / ticks_per_second()


def run(
    address: str, store_pid: int, linger_s: float, shared_memory: bool, args: argparse.Namespace, tag: str
) -> tuple[float, float]:
    """(worker CPU s, store CPU s) to save args.blocks fresh blocks."""
    cache = KVCache.allocate(
        num_blocks=CACHE_BLOCKS, num_layers=GEOMETRY.num_layers, block_size=GEOMETRY.block_size,
        num_kv_heads=GEOMETRY.num_kv_heads, head_dim=GEOMETRY.head_dim, dtype=GEOMETRY.dtype,
        device=torch.device("cpu"), layout=HND,
    )  # fmt: skip
    transfer = KVTransfer(
        address, "meshserve-kv1:" + "5a" * 32, GEOMETRY, cache.layers, HND, CpuPlatform(),
        save_queue_blocks=args.blocks, save_linger_s=linger_s, shared_memory=shared_memory,
    )  # fmt: skip
    worker0, store0 = cpu_seconds(os.getpid()), cpu_seconds(store_pid)
    try:
        for start in range(0, args.blocks, args.per_step):
            transfer.save(
                [
                    worker_pb2.KVBlockRef(
                        block_id=i % CACHE_BLOCKS, block_hash=hashlib.sha256(f"{tag}-{i}".encode()).digest()
                    )
                    for i in range(start, min(args.blocks, start + args.per_step))
                ]
            )
            time.sleep(args.step_interval)
        deadline = time.monotonic() + WAIT_S
        while transfer.stats.blocks_saved + transfer.stats.saves_dropped < args.blocks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{transfer.stats.blocks_saved} of {args.blocks} blocks saved")
            time.sleep(0.01)
        if transfer.stats.saves_dropped:
            raise RuntimeError(f"{transfer.stats.saves_dropped} saves dropped: {transfer.stats.errors}")
        return cpu_seconds(os.getpid()) - worker0, cpu_seconds(store_pid) - store0
    finally:
        transfer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1600, help="blocks saved per configuration (a mixed run's)")
    parser.add_argument("--per-step", type=int, default=2, help="blocks one step completes")
    parser.add_argument("--step-interval", type=float, default=0.01, help="seconds between steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--linger", type=float, default=0.25, help="the linger compared with none (seconds)")
    args = parser.parse_args()
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="kv-save-cost-")))
    try:
        store = start_kvstore(launcher, "kvstore", args=["--capacity", "16GiB"])
        mb = args.blocks * GEOMETRY.slice_nbytes / 1e6
        print(f"{args.blocks} blocks ({mb:.0f} MB), {args.per_step} per step every {args.step_interval * 1e3:.0f} ms")
        configs = {"bytes": (0.0, False), f"bytes, linger {args.linger} s": (args.linger, False),
                   "shared memory": (0.0, True)}  # fmt: skip
        print("| saves | round | worker CPU s | store CPU s | both |")
        print("| --- | ---: | ---: | ---: | ---: |")
        totals: dict[str, list[float]] = {name: [] for name in configs}
        for round_ in range(args.rounds):
            for name, (linger, shared) in configs.items():
                worker, kvstore = run(store.address, store.process.pid, linger, shared, args, f"{round_}-{name}")
                totals[name].append(worker + kvstore)
                print(f"| {name} | {round_ + 1} | {worker:.2f} | {kvstore:.2f} | {worker + kvstore:.2f} |")
        medians = {name: sorted(v)[len(v) // 2] for name, v in totals.items()}
        for name, median in medians.items():
            print(f"median CPU, {name}: {median:.2f} s ({median / medians['bytes']:.2f}x the bytes baseline)")
    finally:
        launcher.stop_all(timeout=10)


if __name__ == "__main__":
    main()
