"""What moving KV blocks between the CPU cache and the kvstore's canonical slices costs the model thread.

The worker gathers a step's saved blocks on its model thread right after the step (kv_transfer.save) and
its load thread scatters loaded ones back. On the CPU the cache is one stacked tensor
(kv_cache.KVCache.allocate), so both are one indexed copy over every layer (kv_blocks.stacked_view); this
compares that with the per-layer path (one copy per layer and K/V, what a cache of separate tensors
takes) on a SmolLM2-135M-shaped bf16 cache: 30 layers, 3 KV heads, 16-token blocks (368,640 bytes each).
Best of --repeats timings of --calls calls each, then the per-layer / stacked ratio.

    python scripts/kv_block_copy.py            # a few seconds

A script a person runs, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from services.worker.kv_blocks import gather_blocks, scatter_blocks, stacked_view
from services.worker.kv_cache import KVCache
from services.worker.layers.attention import HND, NHD


def best_ms(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


Layers = list[tuple[torch.Tensor, torch.Tensor]]


def _gather(layers: Layers, ids: list[int], layout: str) -> torch.Tensor:
    return gather_blocks(layers, ids, layout)


def _scatter(layers: Layers, ids: list[int], slices: torch.Tensor, layout: str) -> None:
    scatter_blocks(layers, ids, slices, layout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 8, 64], help="blocks moved per call")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    print("| layout | blocks | op | per-layer ms | stacked ms | per-layer / stacked |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for layout in (HND, NHD):
        cache = KVCache.allocate(
            num_blocks=4096, num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16,
            device=torch.device("cpu"), layout=layout,
        )  # fmt: skip
        for k, v in cache.layers:
            k.normal_()
            v.normal_()
        separate = [(k.clone(), v.clone()) for k, v in cache.layers]
        if stacked_view(cache.layers, layout) is None or stacked_view(separate, layout) is not None:
            raise SystemExit("expected the allocated cache stacked and its copies not")
        for n in args.blocks:
            ids = list(range(5, 5 + 31 * n, 31))
            slices = gather_blocks(separate, ids, layout)
            if not torch.equal(gather_blocks(cache.layers, ids, layout), slices):
                raise SystemExit("the two paths gathered different bytes")
            ops: dict[str, Callable[[Layers], object]] = {
                "gather": partial(_gather, ids=ids, layout=layout),
                "scatter": partial(_scatter, ids=ids, slices=slices, layout=layout),
            }
            for op, call in ops.items():
                times = [
                    best_ms(partial(call, layers), args.calls, args.repeats) for layers in (separate, cache.layers)
                ]
                print(f"| {layout} | {n} | {op} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.1f}x |")


if __name__ == "__main__":
    main()
