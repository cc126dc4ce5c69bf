"""One SmolLM2 decode step's matmuls, in order, each layer with weights of its own, per weight format.

    python -m services.worker.benchmarks.step_matmuls [--rows 1 2 4 8] [--repeats 5]

A step multiplies every weight once, 30 layers' worth of them (270 MB in bf16), so they come from memory,
not the cache: timing each shape alone on one warm weight (`benchmarks.int8_linear`) flatters whatever
reads the most bytes. Here the 121 matmuls of a step (fused qkv, o, fused gate_up, down per layer, then
the LM head) run in sequence on distinct random weights, for each path:

  bf16     oneDNN on the weight packed as a bf16 model's is here: in bf16 where the CPU runs bf16 natively,
           else in fp32 (the input widened, the output rounded back)
  half     meshserve_cpu::half_linear on the bf16 weight itself (a bf16 model's small steps where the CPU
           has no native bf16 GEMM: platform.half_max_rows)
  tiles    meshserve_cpu::half_linear on the bf16 weight packed into AMX tiles (a bf16 model's steps of up to
           128 rows where the kernels multiply on AMX; only on such a host)
  int8     meshserve_cpu::int8_linear, one scale per row (--quantization int8)
  gguf     meshserve_cpu::int4_linear on Q4_1 blocks and int8_linear on a Q8_0 LM head, as the embedded
           model's GGUF file holds them (--quantization gguf)

Median milliseconds per step over --repeats passes, and the bytes each path reads; the row count up to
which a path wins is what platforms/cpu.py's SMALL_STEP_MAX_ROWS is set from.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from dataclasses import dataclass

import torch

from services.worker.benchmarks.int8_linear import median_us
from services.worker.kernels import loader
from services.worker.layers.quantization import (
    Int4Weight,
    Int8Weight,
    quantize_int4,
    quantize_int8,
    tile_half_weight,
    tile_int8_weight,
)
from services.worker.platforms.cpu import CpuPlatform

# (out_features, in_features) of SmolLM2-135M's per-layer matmuls: fused qkv, o, fused gate_up, down.
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LM_HEAD = (49152, 576)
LAYERS = 30


@dataclass
class Matmul:
    """One matmul of the step in every format."""

    in_features: int
    bf16: torch.Tensor
    tiles: torch.Tensor | None
    packed_bf16: torch.Tensor
    int8: Int8Weight
    int8_tiles: Int8Weight | None
    gguf: Int8Weight | Int4Weight


def build(rows_hint: int, pack_dtype: torch.dtype, tiles: bool, int8_tiles: bool) -> list[Matmul]:
    torch.manual_seed(0)
    shapes = [shape for _ in range(LAYERS) for shape in LAYER_SHAPES] + [LM_HEAD]
    step = []
    for index, (out_features, in_features) in enumerate(shapes):
        weight = torch.randn(out_features, in_features) * 0.02
        is_head = index == len(shapes) - 1
        step.append(
            Matmul(
                in_features,
                weight.bfloat16(),
                tile_half_weight(weight.bfloat16()) if tiles else None,
                torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16().to(pack_dtype), rows_hint),
                quantize_int8(weight),
                tile_int8_weight(quantize_int8(weight)) if int8_tiles else None,
                quantize_int8(weight, group_size=32) if is_head else quantize_int4(weight),
            )
        )
    return step


def _run(step: list[Matmul], path: str, inputs: dict[int, torch.Tensor]) -> None:
    for m in step:
        x = inputs[m.in_features]
        if path == "bf16":
            out = torch.ops.mkldnn._linear_pointwise(x.to(m.packed_bf16.dtype), m.packed_bf16, None, "none", [], "")
            out.bfloat16()
        elif path == "half":
            torch.ops.meshserve_cpu.half_linear(x, m.bf16)
        elif path == "tiles":
            torch.ops.meshserve_cpu.half_linear(x, m.tiles)
        elif path == "int8":
            torch.ops.meshserve_cpu.int8_linear(x, m.int8.qweight, m.int8.scales)
        elif path == "int8-tiles":
            assert m.int8_tiles is not None
            torch.ops.meshserve_cpu.int8_linear(x, m.int8_tiles.qweight, m.int8_tiles.scales)
        elif isinstance(m.gguf, Int4Weight):
            torch.ops.meshserve_cpu.int4_linear(x, m.gguf.packed, m.gguf.scales, m.gguf.offsets)
        else:
            torch.ops.meshserve_cpu.int8_linear(x, m.gguf.qweight, m.gguf.scales)


def measure(rows: list[int], repeats: int) -> dict[str, object]:
    loader.load()
    pack_dtype = CpuPlatform(kernels="native").matmul_pack_dtype(torch.bfloat16) or torch.bfloat16
    tiles = bool(torch.ops.meshserve_cpu.half_linear_takes_tiles())
    int8_tiles = bool(torch.ops.meshserve_cpu.int8_linear_takes_tiles())
    step = build(rows_hint=32, pack_dtype=pack_dtype, tiles=tiles, int8_tiles=int8_tiles)
    nbytes = {
        "bf16": sum(m.packed_bf16.numel() * pack_dtype.itemsize for m in step),
        "half": sum(m.bf16.numel() * 2 for m in step),
        **({"tiles": sum(m.bf16.numel() * 2 for m in step)} if tiles else {}),
        "int8": sum(m.int8.nbytes for m in step),
        **({"int8-tiles": sum(m.int8.nbytes for m in step)} if int8_tiles else {}),
        "gguf": sum(m.gguf.nbytes for m in step),
    }
    results = []
    for n in rows:
        inputs = {k: torch.randn(n, k).bfloat16() for k in {m.in_features for m in step}}
        # Interleaved passes, so the host's drift falls on every path alike.
        samples: dict[str, list[float]] = {path: [] for path in nbytes}
        for _ in range(repeats):
            for path, values in samples.items():
                values.append(median_us(functools.partial(_run, step, path, inputs), 1) / 1000)
        times = {path: statistics.median(values) for path, values in samples.items()}
        results.append({"rows": n, **{f"{path}_ms": t for path, t in times.items()}})
    return {"threads": torch.get_num_threads(), "bf16_packed_in": str(pack_dtype), "bytes": nbytes, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    report = measure(args.rows, args.repeats)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))
    paths = [path for path in ("bf16", "half", "tiles", "int8", "int8-tiles", "gguf") if path in report["bytes"]]  # type: ignore[operator]
    others = paths[1:]
    header = [f"{p} ms" for p in paths] + [f"{p} / bf16" for p in others]
    print("\n| rows | " + " | ".join(header) + " |")
    print("| ---: " * (len(paths) + len(others) + 1) + "|")
    for r in report["results"]:  # type: ignore[attr-defined]
        times = [r[f"{p}_ms"] for p in paths]
        ratios = [t / times[0] for t in times[1:]]
        print(f"| {r['rows']} | " + " | ".join(f"{t:.2f}" for t in times + ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
