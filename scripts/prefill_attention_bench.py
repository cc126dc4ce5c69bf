"""The native prefill attention kernel against the reference's per-sequence SDPA, on SmolLM2 shapes.

NativeCpuOps.prefill_attention (kernels/cpu_ops.cpp: paged_prefill_attention) and
ReferenceOps.prefill_attention (torch's CPU flash SDPA, one call per sequence after gathering its blocks)
on the same bf16 paged cache: 9 query heads over 3 KV heads of 64, 16-token blocks in shuffled order. Each
case is a step's prefill chunks (sequence lengths, and how many of their last tokens are queries). The two
run alternately, best of --repeats timings of --calls calls each, then the SDPA / native ratio and the
kernel's useful GFLOP/s (causal QK and PV only). Outputs are checked against each other first.

    python scripts/prefill_attention_bench.py      # about a minute

A script a person runs, not a test.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from services.worker.kernels import loader
from services.worker.layers.attention import HND, cache_shape, reshape_and_cache
from services.worker.platforms.cpu_native_ops import NativeCpuOps
from services.worker.platforms.reference_ops import ReferenceOps

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (sequence lengths, query tokens of each): whole prompts of a prefill step, a chunk after a long cached
# context (a prefix-cache hit), and many short prompts.
CASES: list[tuple[list[int], list[int]]] = [
    ([128], [128]),
    ([512], [512]),
    ([512] * 4, [512] * 4),
    ([1024], [1024]),
    ([256] * 8, [256] * 8),
    ([2048], [2048]),
    ([1064], [64]),
    ([64] * 32, [64] * 32),
]

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def batch(lens: list[int], query_lens: list[int]) -> Batch:
    """q, caches holding the sequences in shuffled blocks, tables, seq_lens and query_start_loc."""
    g = torch.Generator().manual_seed(0)
    num_blocks = sum(math.ceil(n / BLOCK) for n in lens)
    k_cache = torch.zeros(cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, HND), dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lens:
        blocks = [free.pop() for _ in range(math.ceil(n / BLOCK))]
        tables.append(blocks + [0] * (math.ceil(max(lens) / BLOCK) - len(blocks)))
        slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
        reshape_and_cache(k, v, k_cache, v_cache, slots, HND)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=g).bfloat16()
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), starts


def useful_flops(lens: list[int], query_lens: list[int]) -> float:
    """QK and PV multiply-adds of the causal pairs (each query sees its context and itself)."""
    pairs = sum(q * (n - q) + q * (q + 1) / 2 for n, q in zip(lens, query_lens, strict=True))
    return 2 * 2 * pairs * HEADS * HEAD_DIM


def best_ms(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, float]:
    """Best time per call of each function, the functions timed in turn so host drift hits them alike."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1000)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loader.load()
    native, reference = NativeCpuOps(HND), ReferenceOps(HND)
    print("| sequences | query tokens | SDPA ms | native ms | ratio | native GFLOP/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for lens, query_lens in CASES:
        args_ = (*batch(lens, query_lens), HEAD_DIM**-0.5, HND)
        torch.testing.assert_close(
            native.prefill_attention(*args_), reference.prefill_attention(*args_), rtol=2**-7, atol=2**-7
        )
        times = best_ms(
            {"sdpa": partial(reference.prefill_attention, *args_), "native": partial(native.prefill_attention, *args_)},
            args.calls,
            args.repeats,
        )
        gflops = useful_flops(lens, query_lens) / times["native"] / 1e6
        shown = f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else str(lens)
        print(
            f"| {shown} | {len(query_lens)} x {query_lens[0]} | {times['sdpa']:.2f} | {times['native']:.2f} "
            f"| {times['sdpa'] / times['native']:.2f}x | {gflops:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
