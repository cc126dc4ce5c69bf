"""Where a decode step's time goes: ModelRunner.execute under torch's profiler, ops grouped by kind.

    python -m services.worker.benchmarks.step_profile [--batch 1 32] [--quantization int8]
    python -m services.worker.benchmarks.step_profile --device cuda --load-format dummy --model DIR --batch 1 64

For each batch size, `batch` requests with 256-token prompts are prefilled, then `--steps` decode steps
(one token each) are profiled. Ops are grouped into GEMMs, attention (with the KV cache write),
elementwise (norms, SwiGLU, rotary, embedding), sampling and input preparation (building the step's
tensors); what no op accounts for is the runner's own Python. A served step adds the scheduler's plan,
two gRPC hops and the gateway's detokenising on top (compare with `meshserve bench`'s TPOT).

On a device the kinds are the device time of the kernels each kind's ops launched, and "device busy" their
sum: a step whose wall time is well above it waits on the host (Python, launches), which CUDA graphs remove.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.worker.engine_config import DEVICES, LOAD_FORMATS, QUANTIZATIONS, EngineConfig
from services.worker.host_allocator import retain_freed_memory
from services.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
PROMPT_LEN = 256
# Room for 32 such sequences of SmolLM2 in any dtype; a larger model needs a smaller --batch.
KV_CACHE_BYTES = 1 << 30
# Op name fragments per kind, matched in order (the first that matches wins).
KINDS = (
    ("gemm", ("linear", "addmm", "aten::mm", "matmul", "int8_linear", "_linear_pointwise")),
    ("attention", ("attention", "reshape_and_cache", "sdpa", "bmm")),
    ("elementwise", ("rms_norm", "silu", "rotary", "embedding", "aten::add", "aten::mul", "index_select")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "log_softmax", "exponential", "div_")),
    ("input preparation", ("aten::tensor", "aten::to", "_to_copy", "copy_", "lift_fresh", "aten::index")),
)


def _kind(name: str) -> str:
    return next((kind for kind, parts in KINDS if any(p in name for p in parts)), "other ops")


def _decode_steps(steps: int) -> int:
    """Decode steps a profile runs: a warm one, `steps` timed alone, `steps` under the profiler, one spare."""
    return 2 * steps + 2


def _runner(
    model_dir: Path, dtype: str, batch: int, steps: int, quantization: str | None, device: str, load_format: str
) -> ModelRunner:
    max_len = PROMPT_LEN + _decode_steps(steps)
    # As a worker process runs its model (ranks.prepare_rank).
    retain_freed_memory()
    return ModelRunner(
        EngineConfig(
            model_path=str(model_dir),
            dtype=dtype,
            quantization=quantization,
            device=device,
            load_format=load_format,
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_model_len=max_len,
            max_num_batched_tokens=max(batch * PROMPT_LEN, 512),
            max_num_seqs=batch,
        )
    )


def profile_batch(
    model_dir: Path,
    dtype: str,
    batch: int,
    steps: int,
    quantization: str | None,
    wall_only: bool = False,
    device: str = "cpu",
    load_format: str = "auto",
) -> dict[str, float]:
    """Milliseconds per decode step by kind, plus the step's wall time (alone, without the profiler's own
    per-op cost, when wall_only)."""
    runner = _runner(model_dir, dtype, batch, steps, quantization, device, load_format)
    blocks_per = -(-(PROMPT_LEN + _decode_steps(steps)) // BLOCK_SIZE)
    greedy = sampling_pb2.SamplingParams(temperature=0.0)
    prefill = worker_pb2.Step(step_id=1)
    for i in range(batch):
        prefill.new_requests.append(
            worker_pb2.NewRequest(
                request_id=f"r{i}",
                prompt_token_ids=[(7 * i + j) % (runner.vocab_size - 10) + 10 for j in range(PROMPT_LEN)],
                sampling=greedy,
                block_ids=list(range(i * blocks_per, (i + 1) * blocks_per)),
                num_scheduled_tokens=PROMPT_LEN,
            )
        )
    runner.execute(prefill)
    computed = PROMPT_LEN

    def decode() -> None:
        nonlocal computed
        step = worker_pb2.Step(step_id=2 + computed - PROMPT_LEN)
        for i in range(batch):
            step.scheduled.append(
                worker_pb2.ScheduledRequest(request_id=f"r{i}", num_computed_tokens=computed, num_scheduled_tokens=1)
            )
        result = runner.execute(step)
        if result.error:
            raise RuntimeError(result.error)
        computed += 1

    def timed_steps() -> float:
        """Milliseconds per step over `steps` decode steps."""
        started = time.perf_counter()
        for _ in range(steps):
            decode()
        return (time.perf_counter() - started) / steps * 1000

    decode()  # warm
    wall_alone = timed_steps()
    if wall_only:
        runner.close()
        return {"step_ms": wall_alone}
    on_device = runner.device_type != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        wall = timed_steps()
    runner.close()
    if on_device:
        return {"step_ms": wall_alone, "step_ms_profiled": wall, **_device_kinds(prof, steps, wall_alone)}
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        totals[_kind(event.key)] += event.self_cpu_time_total / 1000 / steps
    ops = sum(totals.values())
    return {"step_ms": wall, **{k: round(v, 3) for k, v in totals.items()}, "python (runner)": max(0.0, wall - ops)}


def _device_kinds(prof: profile, steps: int, wall: float) -> dict[str, float]:
    """Per step: the device time of the kernels each kind of op launched, their sum (device busy), and the
    wall time no kernel ran (host-bound: Python, launches, synchronisation)."""
    totals: dict[str, float] = defaultdict(float)
    busy = 0.0
    launches = 0
    for event in prof.key_averages():
        device_us = float(getattr(event, "self_device_time_total", 0.0))
        if event.device_type == DeviceType.CPU:
            totals[_kind(event.key)] += device_us / 1000 / steps
        else:
            busy += device_us / 1000 / steps
            launches += event.count
    return {
        **{k: round(v, 3) for k, v in totals.items()},
        "device busy": round(busy, 3),
        "device idle": round(max(0.0, wall - busy), 3),
        "kernels per step": round(launches / steps, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    parser.add_argument("--device", default="cpu", choices=DEVICES)
    parser.add_argument(
        "--load-format", default="auto", choices=LOAD_FORMATS, help="dummy: random weights (a config.json is enough)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--wall-only", action="store_true", help="time the steps without the profiler (which adds per-op cost)"
    )
    args = parser.parse_args(argv)
    if args.model is None:
        from services.worker.model_fetch import ensure_embedded_model

        args.model = ensure_embedded_model()
    for batch in args.batch:
        row = profile_batch(
            args.model, args.dtype, batch, args.steps, args.quantization, args.wall_only, args.device, args.load_format
        )
        print(json.dumps({"batch": batch, "quantization": args.quantization, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
