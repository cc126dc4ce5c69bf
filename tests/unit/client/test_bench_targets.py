"""scripts/bench_targets.py's own arithmetic: the median run and the verdict line."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from services.client.bench.metrics import summarize
from services.client.bench.records import RequestRecord

ROOT = Path(__file__).resolve().parents[3]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_targets", ROOT / "scripts" / "bench_targets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_targets"] = module
    spec.loader.exec_module(module)
    return module


def test_median_run_picks_the_middle_run_by_the_metric() -> None:
    bt = _script()
    base = summarize([RequestRecord(prompt_len=4, output_len=2, start=0.0, token_times=[0.1, 0.2])], 1.0, backend="x")
    runs = [dataclasses.replace(base, output_throughput=v, mean_tpot_ms=10 - v) for v in (5.0, 1.0, 9.0, 3.0)]
    assert bt.median_run(runs[:3], "output_throughput").output_throughput == 5.0
    # An even count takes the lower middle one; for TPOT (lower is better) the order flips with the values.
    assert bt.median_run(runs, "output_throughput").output_throughput == 3.0
    assert bt.median_run(runs, "mean_tpot_ms").mean_tpot_ms == 5.0
    verdict = bt.Verdict("b", "steady", "w", "tok/s", 3.0, "raw", 4.0, 0.75, 0.9, "m / r", [3.0, 2.5], [4.0, 4.2])
    assert verdict.line().endswith("MISS; medians of runs [3.00, 2.50] and [4.00, 4.20]")
    single = bt.Verdict("c", "one", "w", "ms", 2.0, "tf", 3.0, 1.5, 1.0, "t / m", [2.0], [3.0])
    assert single.line().endswith("(target >= 1x) PASS")
