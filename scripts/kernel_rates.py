"""How fast the small-step linear kernels read their weights at one row of x: from memory, in the L3, per call.

    python scripts/kernel_rates.py                          # the library the loader builds for this tree
    python scripts/kernel_rates.py --library OLD.so --label old   # another build (a worktree's cache, say)

For `half_linear` (bf16 weights) and `int8_linear` (int8, one scale a row), the GB/s of weights read:
- `step`: a SmolLM2 decode step's 121 matmuls, each layer with weights of its own, so each call starts
  from memory as in a served step (what `benchmarks.step_matmuls` times, here per kernel);
- `one matrix`: the same bytes as one large matrix (the memory's rate without per-call costs);
- `in L3`: one 2,048 x 576 matrix called again and again (the kernel's arithmetic rate);
- `fixed cost`: microseconds of a call on 16 x 576.
Two builds of the library register the same operators, so compare them in alternated processes; this
host's memory rate moves between runs (docs/benchmarks.md). A script a person runs, not a test.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from services.worker.benchmarks.int8_linear import median_us
from services.worker.benchmarks.step_matmuls import LAYER_SHAPES, LAYERS, LM_HEAD

HOT_SHAPE = (2048, 576)
FIXED_SHAPE = (16, 576)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    return median_us(fn, repeats) / 1e6


def _int8(shape: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=g), torch.rand(shape[0], 1, generator=g)


def measure(repeats: int) -> dict[str, dict[str, float]]:
    """GB/s (and the fixed cost in microseconds) of each kernel at one row."""
    op = torch.ops.meshserve_cpu
    g = torch.Generator().manual_seed(0)
    shapes = [*LAYER_SHAPES * LAYERS, LM_HEAD]
    total = sum(n * k for n, k in shapes)
    x = {k: torch.randn(1, k, generator=g).bfloat16() for k in {k for _, k in shapes}}
    half = [torch.randn(shape, generator=g).bfloat16() for shape in shapes]
    int8 = [_int8(shape, g) for shape in shapes]
    big_half = torch.randn(total // LM_HEAD[1], LM_HEAD[1], generator=g).bfloat16()
    big_int8 = _int8((total // LM_HEAD[1], LM_HEAD[1]), g)
    hot_half = torch.randn(HOT_SHAPE, generator=g).bfloat16()
    hot_int8 = _int8(HOT_SHAPE, g)
    fixed_half = torch.randn(FIXED_SHAPE, generator=g).bfloat16()
    fixed_int8 = _int8(FIXED_SHAPE, g)
    x_big, hot_calls = x[LM_HEAD[1]], 200

    def rate(weight_bytes: int, seconds: float) -> float:
        return round(weight_bytes / seconds / 1e9, 2)

    def hot(fn: Callable[[], object]) -> float:
        return _median_seconds(lambda: [fn() for _ in range(hot_calls)], repeats) / hot_calls

    return {
        "half_linear": {
            "step GB/s": rate(
                2 * total, _median_seconds(lambda: [op.half_linear(x[w.shape[1]], w) for w in half], repeats)
            ),
            "one matrix GB/s": rate(
                2 * big_half.numel(), _median_seconds(lambda: op.half_linear(x_big, big_half), repeats)
            ),
            "in L3 GB/s": rate(2 * hot_half.numel(), hot(lambda: op.half_linear(x_big, hot_half))),
            "fixed cost us": round(hot(lambda: op.half_linear(x_big, fixed_half)) * 1e6, 2),
        },
        "int8_linear": {
            "step GB/s": rate(
                total, _median_seconds(lambda: [op.int8_linear(x[q.shape[1]], q, s) for q, s in int8], repeats)
            ),
            "one matrix GB/s": rate(
                big_int8[0].numel(), _median_seconds(lambda: op.int8_linear(x_big, *big_int8), repeats)
            ),
            "in L3 GB/s": rate(hot_int8[0].numel(), hot(lambda: op.int8_linear(x_big, *hot_int8))),
            "fixed cost us": round(hot(lambda: op.int8_linear(x_big, *fixed_int8)) * 1e6, 2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", help="a built meshserve_cpu_ops.so (default: the loader's, built if need be)")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.library:
        torch.ops.load_library(args.library)
    else:
        from services.worker.kernels import loader

        loader.load()
    print(json.dumps({"label": args.label, "threads": torch.get_num_threads(), **measure(args.repeats)}))


if __name__ == "__main__":
    main()
