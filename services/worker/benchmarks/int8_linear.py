"""The int8 weight-only kernel against the bf16 paths it replaces, by rows per step, on SmolLM2's shapes.

    python -m services.worker.benchmarks.int8_linear [--rows 1 2 4 8 16 32 64]

For each linear shape and row count: median microseconds of `meshserve_cpu::int8_linear`, of oneDNN on
the fp32-packed weight (the bf16 path on hosts without native bf16), of oneDNN on the bf16-packed weight
(the bf16 path where the CPU runs bf16 natively: AMX, avx512_bf16) and of ATen's bf16 GEMM with oneDNN
off (the one-row path on the former), plus the host's copy bandwidth and what one step's weight bytes
cost at it (the floor). Each shape is timed alone, so its weight may sit in the CPU's caches: where they
are large, take the crossover from whole steps (`step_profile --wall-only`), which is what the CPU
platform's SMALL_STEP_MAX_ROWS for quantised weights is set from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from services.worker.kernels import loader
from services.worker.layers.quantization import quantize_int8

# (name, out_features, in_features) of SmolLM2-135M's matmuls: fused qkv, o, fused gate_up, down, LM head.
SHAPES = (
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
)
# Per decoder layer (30 layers) plus the LM head once: the matmuls of one SmolLM2 step.
LAYERS = 30


def median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def copy_bandwidth_gbs(megabytes: int = 256, repeats: int = 5) -> float:
    """Host memory bandwidth as a large tensor copy sees it (read + write bytes per second)."""
    src = torch.ones(megabytes << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = median_us(lambda: dst.copy_(src), repeats) / 1e6
    return 2 * src.numel() * 4 / seconds / 1e9


def _time_paths(
    weight: torch.Tensor, packed: torch.Tensor, packed_bf16: torch.Tensor | None, rows: int, repeats: int
) -> dict[str, float]:
    q = quantize_int8(weight)
    x = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16)
    xf = x.float()
    times = {
        "int8_us": median_us(lambda: torch.ops.meshserve_cpu.int8_linear(x, q.qweight, q.scales), repeats),
        "onednn_fp32_us": median_us(
            lambda: torch.ops.mkldnn._linear_pointwise(xf, packed, None, "none", [], "").bfloat16(), repeats
        ),
    }
    if packed_bf16 is not None:
        times["onednn_bf16_us"] = median_us(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed_bf16, None, "none", [], ""), repeats
        )
    torch._C._set_mkldnn_enabled(False)
    try:
        times["aten_bf16_us"] = median_us(lambda: torch.nn.functional.linear(x, weight), repeats)
    finally:
        torch._C._set_mkldnn_enabled(True)
    return times


def measure(rows: list[int], repeats: int) -> dict[str, object]:
    loader.load()
    torch.manual_seed(0)
    results = []
    for name, out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), 32)
        native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(weight, 32) if native else None
        for n in rows:
            results.append({"shape": name, "rows": n, **_time_paths(weight, packed, packed_bf16, n, repeats)})
    bandwidth = copy_bandwidth_gbs()
    params = sum(o * i * (1 if name == "lm_head" else LAYERS) for name, o, i in SHAPES)
    return {
        "threads": torch.get_num_threads(),
        "copy_bandwidth_gbs": bandwidth,
        "step_weight_params": params,
        "floor_ms": {"bf16": params * 2 / bandwidth / 1e6, "int8": params / bandwidth / 1e6},
        "results": results,
    }


def step_totals(report: dict[str, object]) -> dict[int, dict[str, float]]:
    """Per row count, one step's matmul time (ms) for each path: per-layer shapes x 30 plus the LM head."""
    totals: dict[int, dict[str, float]] = {}
    for r in report["results"]:  # type: ignore[attr-defined]
        weight = 1 if r["shape"] == "lm_head" else LAYERS
        row = totals.setdefault(r["rows"], {key[:-3]: 0.0 for key in r if key.endswith("_us")})
        for key in row:
            row[key] += r[f"{key}_us"] * weight / 1000
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    report = measure(args.rows, args.repeats)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))
    totals = step_totals(report)
    paths = [p for p in ("onednn_fp32", "onednn_bf16", "aten_bf16") if p in next(iter(totals.values()), {})]
    print("\n| rows | int8 ms/step | " + " | ".join(f"{p} ms/step" for p in paths) + " | int8 / best bf16 path |")
    print("| ---: " * (len(paths) + 3) + "|")
    for rows, t in sorted(totals.items()):
        best = min(t[p] for p in paths)
        cells = " | ".join(f"{t[p]:.2f}" for p in paths)
        print(f"| {rows} | {t['int8']:.2f} | {cells} | {t['int8'] / best:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
