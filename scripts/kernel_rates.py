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


def _half(shape: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(shape, generator=g).bfloat16(),)


def _int8(shape: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=g), torch.rand(shape[0], 1, generator=g)


# Each kernel: its operator's name, how to make a weight of a shape, and the bytes of one weight element.
KERNELS: tuple[tuple[str, Callable[[tuple[int, int], torch.Generator], tuple[torch.Tensor, ...]], int], ...] = (
    ("half_linear", _half, 2),
    ("int8_linear", _int8, 1),
)


def _rates(
    op: Callable[..., torch.Tensor],
    make: Callable[[tuple[int, int], torch.Generator], tuple[torch.Tensor, ...]],
    element_bytes: int,
    repeats: int,
) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    shapes = [*LAYER_SHAPES * LAYERS, LM_HEAD]
    total = sum(n * k for n, k in shapes)
    x = {k: torch.randn(1, k, generator=g).bfloat16() for k in {k for _, k in shapes}}
    x_big, hot_calls = x[LM_HEAD[1]], 200
    step = [make(shape, g) for shape in shapes]
    big = make((total // LM_HEAD[1], LM_HEAD[1]), g)
    in_l3 = make(HOT_SHAPE, g)
    fixed = make(FIXED_SHAPE, g)

    def gbs(weights: int, seconds: float) -> float:
        return round(weights * element_bytes / seconds / 1e9, 2)

    def per_call(weight: tuple[torch.Tensor, ...]) -> float:
        return _median_seconds(lambda: [op(x_big, *weight) for _ in range(hot_calls)], repeats) / hot_calls

    return {
        "step GB/s": gbs(total, _median_seconds(lambda: [op(x[w[0].shape[1]], *w) for w in step], repeats)),
        "one matrix GB/s": gbs(big[0].numel(), _median_seconds(lambda: op(x_big, *big), repeats)),
        "in L3 GB/s": gbs(in_l3[0].numel(), per_call(in_l3)),
        "fixed cost us": round(per_call(fixed) * 1e6, 2),
    }


def measure(repeats: int) -> dict[str, dict[str, float]]:
    """GB/s (and the fixed cost in microseconds) of each kernel at one row."""
    return {
        name: _rates(getattr(torch.ops.meshserve_cpu, name), make, element_bytes, repeats)
        for name, make, element_bytes in KERNELS
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
