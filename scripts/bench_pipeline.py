"""Pipeline bubbles: steady decode at batch 32 with the layers in one stage and in two, each rank's share of a
step spent computing and spent waiting.

The worker's own ranks (ModelRunner in spawned processes, rank 0 broadcasting every Step as the worker does),
driven by this script in the scheduler's place: one prefill step of --batch prompts, then --steps decode
steps of one token each. Every rank times its stage's compute (its layers, and on the last stage the logits
and sampling) and each step's wall time; a step's wait is the rest (for the previous stage's activations,
the next stage's tokens, the command). On 2 cores the point is the bubble, not a speed-up.

    python scripts/bench_pipeline.py                    # SmolLM2 (embedded), PP=1 then PP=2
    python scripts/bench_pipeline.py --pp 1 2 --steps 48

A script a person runs, not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.ports import free_port  # noqa: E402
from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2  # noqa: E402
from services.worker.distributed import DistInit  # noqa: E402
from services.worker.engine_config import EngineConfig  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.tp_ranks import Command, prepare_rank, send_command, serve_commands  # noqa: E402

BLOCK_SIZE = 16
WARMUP_STEPS = 4


@dataclass
class RankTimes:
    """One rank's timings over the measured decode steps."""

    rank: int
    stage: int
    step_seconds: list[float]
    busy_seconds: list[float]


def _timed(runner: ModelRunner, busy: list[float]) -> None:
    """Count the time in this rank's own compute: its layers' forward, the logits and sampling."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[-1] += time.perf_counter() - start

        return timed

    runner.model.forward = wrap(runner.model.forward)  # type: ignore[method-assign]
    runner.model.compute_logits = wrap(runner.model.compute_logits)  # type: ignore[method-assign]
    runner.sampler.sample = wrap(runner.sampler.sample)  # type: ignore[method-assign]


def _record_steps(runner: ModelRunner, times: RankTimes) -> None:
    execute = runner.execute

    def timed(step: worker_pb2.Step) -> worker_pb2.StepResult:
        times.busy_seconds.append(0.0)
        start = time.perf_counter()
        result = execute(step)
        times.step_seconds.append(time.perf_counter() - start)
        return result

    runner.execute = timed  # type: ignore[method-assign]


def _follower(config: EngineConfig, dist: DistInit, ranks: int, out: str) -> None:
    prepare_rank(config, dist.local_rank, ranks, "auto")
    runner = ModelRunner(config, dist)
    times = RankTimes(dist.rank, runner.stage.index, [], [])
    _timed(runner, times.busy_seconds)
    _record_steps(runner, times)
    serve_commands(runner)
    Path(out).write_text(json.dumps(times.__dict__))


def _steps(batch: int, prompt_len: int, num_steps: int) -> list[worker_pb2.Step]:
    """A prefill of `batch` prompts, then num_steps decode steps (a new block when a request crosses one)."""
    per_request = -(-(prompt_len + num_steps + 1) // BLOCK_SIZE)
    greedy = sampling_pb2.SamplingParams(temperature=0.0)
    new = []
    for i in range(batch):
        blocks = list(range(i * per_request, (i + 1) * per_request))
        prompt = [(7 * i + 13 * j) % 40000 + 100 for j in range(prompt_len)]
        new.append(
            worker_pb2.NewRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=greedy, block_ids=blocks,
                                  num_computed_tokens=0, num_scheduled_tokens=prompt_len)
        )  # fmt: skip
    steps = [worker_pb2.Step(step_id=1, new_requests=new)]
    for k in range(num_steps):
        scheduled = [worker_pb2.ScheduledRequest(request_id=f"r{i}", num_computed_tokens=prompt_len + k,
                                                 num_scheduled_tokens=1) for i in range(batch)]  # fmt: skip
        steps.append(worker_pb2.Step(step_id=k + 2, scheduled=scheduled))
    return steps


def run(model: str, pp: int, args: argparse.Namespace, tmp: Path) -> list[RankTimes]:
    config = EngineConfig(model_path=model, device="cpu", dtype=args.dtype, pipeline_parallel_size=pp,
                          max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len,
                          kv_cache_memory_bytes=1 << 30, max_model_len=args.prompt_len + args.steps + 16)  # fmt: skip
    init = DistInit(rank=0, world_size=pp, local_rank=0, init_method=f"tcp://127.0.0.1:{free_port()}")
    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, pp):
        dist = DistInit(rank=rank, world_size=pp, local_rank=rank, init_method=init.init_method)
        process = context.Process(target=_follower, args=(config, dist, pp, str(tmp / f"rank{rank}.json")))
        process.start()
        processes.append(process)
    prepare_rank(config, 0, pp, "auto")
    runner = ModelRunner(config, init if pp > 1 else None)
    times = RankTimes(0, 0, [], [])
    _timed(runner, times.busy_seconds)
    _record_steps(runner, times)
    for step in _steps(args.batch, args.prompt_len, args.steps):
        if pp > 1:
            send_command(runner, Command.STEP, step.SerializeToString())
        result = runner.execute(step)
        assert not result.error, result.error
    if pp > 1:
        send_command(runner, Command.SHUTDOWN)
    for process in processes:
        process.join(120)
        assert process.exitcode == 0, f"rank process exited {process.exitcode}"
    ranks = [times] + [RankTimes(**json.loads((tmp / f"rank{r}.json").read_text())) for r in range(1, pp)]
    for t in ranks:
        # The prefill and the first decode steps warm the kernels: steady decode only.
        t.step_seconds, t.busy_seconds = t.step_seconds[1 + WARMUP_STEPS :], t.busy_seconds[1 + WARMUP_STEPS :]
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2], help="pipeline sizes to run, in order")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48, help="decode steps (the first 4 are warm-up)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from services.worker.model_fetch import ensure_embedded_model

        model = str(ensure_embedded_model())
    # Each run's ranks share the host's cores (prepare_rank splits them), as a worker's do.
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    report: dict[str, Any] = {"batch": args.batch, "prompt_len": args.prompt_len, "dtype": args.dtype, "runs": []}
    baseline = None
    for pp in args.pp:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run(model, pp, args, Path(tmp))
        step_ms = statistics.median(ranks[0].step_seconds) * 1000
        baseline = baseline or step_ms
        print(f"PP={pp}: median decode step {step_ms:.1f} ms ({step_ms / baseline:.2f}x PP={args.pp[0]}), "
              f"{args.batch * 1000 / step_ms:.1f} tok/s")  # fmt: skip
        stages = []
        for t in ranks:
            wall, busy = sum(t.step_seconds), sum(t.busy_seconds)
            stages.append({"rank": t.rank, "stage": t.stage, "wait_fraction": round(1 - busy / wall, 3),
                           "busy_ms_per_step": round(busy / len(t.busy_seconds) * 1000, 2)})  # fmt: skip
            print(f"  stage {t.stage} (rank {t.rank}): computes {busy / len(t.busy_seconds) * 1000:.1f} ms a step, "
                  f"waits {100 * (1 - busy / wall):.0f}% of it")  # fmt: skip
        report["runs"].append({"pp": pp, "median_step_ms": round(step_ms, 2), "stages": stages})
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
