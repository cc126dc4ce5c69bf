"""Pipeline bubbles: steady decode at batch 32 with the layers in one stage and in two, one step at a time and
micro-batched; how much of the time each stage computes and how much it waits.

The worker's own ranks (ModelRunner in spawned processes; rank 0 sending every Step as the worker does, or
PipelineDriver when micro-batched) driven by this script in the scheduler's place: one prefill of --batch
prompts, then decode rounds in which every request gains one token: one step of all of them, or --batch / P
requests in each of P micro-batches kept in flight together. Every rank records when it computes (its
layers, and on the last stage the logits and sampling); over the measured rounds, a stage's wait is the
rest of the wall time (for the previous stage's activations, the next stage's tokens, a command). On two
cores the point is the bubble, not a speed-up.

    python scripts/bench_pipeline.py                  # SmolLM2 (embedded), fp32: PP=1, PP=2 serial, PP=2 micro
    python scripts/bench_pipeline.py --rounds 48 --out docs/benchmarks/pipeline.json

A script a person runs, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.ports import free_port  # noqa: E402
from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2  # noqa: E402
from services.worker.distributed import DistInit, destroy_groups  # noqa: E402
from services.worker.engine_config import EngineConfig  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.pipeline_driver import PipelineDriver  # noqa: E402
from services.worker.ranks import Command, prepare_rank, send_command, serve_commands  # noqa: E402
from services.worker.settings import parse_layer_partition  # noqa: E402

BLOCK_SIZE = 16
WARMUP_ROUNDS = 4
Interval = tuple[float, float]


@dataclass(frozen=True)
class Mode:
    name: str
    pp: int
    micro_batched: bool


MODES = {
    "pp1": Mode("PP=1", 1, False),
    "pp2": Mode("PP=2, one step at a time", 2, False),
    "pp2-micro": Mode("PP=2, two micro-batches in flight", 2, True),
}


def _record_compute(runner: ModelRunner, busy: list[Interval]) -> None:
    """Record when this rank computes: its layers' forward, the logits and sampling (perf_counter is
    CLOCK_MONOTONIC, one clock for every process of the host)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy.append((start, time.perf_counter()))

        return timed

    runner.model.forward = wrap(runner.model.forward)  # type: ignore[method-assign]
    runner.model.compute_logits = wrap(runner.model.compute_logits)  # type: ignore[method-assign]
    runner.sampler.sample = wrap(runner.sampler.sample)  # type: ignore[method-assign]


def _follower(config: EngineConfig, dist: DistInit, ranks: int, out: str) -> None:
    prepare_rank(config, dist.local_rank, ranks, "auto")
    runner = ModelRunner(config, dist)
    busy: list[Interval] = []
    _record_compute(runner, busy)
    serve_commands(runner)
    Path(out).write_text(json.dumps({"stage": runner.stage.index, "busy": busy}))


class _Group:
    """One micro-batch's requests and the steps that advance them a token at a time."""

    def __init__(self, name: str, size: int, first_block: int, args: argparse.Namespace) -> None:
        per_request = -(-(args.prompt_len + WARMUP_ROUNDS + args.rounds + 2) // BLOCK_SIZE)
        self.ids = [f"{name}-{i}" for i in range(size)]
        self.blocks = {rid: list(range(first_block + i * per_request, first_block + (i + 1) * per_request))
                       for i, rid in enumerate(self.ids)}  # fmt: skip
        self.num_blocks = size * per_request
        self.prompt_len = args.prompt_len
        self.num_computed = 0

    def prefill(self, step_id: int) -> worker_pb2.Step:
        greedy = sampling_pb2.SamplingParams(temperature=0.0)
        new = [
            worker_pb2.NewRequest(request_id=rid, prompt_token_ids=[(7 * i + 13 * j) % 40000 + 100
                                  for j in range(self.prompt_len)], sampling=greedy, block_ids=self.blocks[rid],
                                  num_computed_tokens=0, num_scheduled_tokens=self.prompt_len)
            for i, rid in enumerate(self.ids)
        ]  # fmt: skip
        self.num_computed = self.prompt_len
        return worker_pb2.Step(step_id=step_id, new_requests=new)

    def decode(self, step_id: int) -> worker_pb2.Step:
        scheduled = [worker_pb2.ScheduledRequest(request_id=rid, num_computed_tokens=self.num_computed,
                                                 num_scheduled_tokens=1) for rid in self.ids]  # fmt: skip
        self.num_computed += 1
        return worker_pb2.Step(step_id=step_id, scheduled=scheduled)


def _rounds(groups: list[_Group], count: int, ids: itertools.count[int], prefill: bool) -> list[list[worker_pb2.Step]]:
    """count rounds of one step per group (the first its prefill when asked)."""
    return [[g.prefill(next(ids)) if prefill and r == 0 else g.decode(next(ids)) for g in groups] for r in range(count)]


def _drive_serial(runner: ModelRunner, pp: int, rounds: list[list[worker_pb2.Step]]) -> None:
    for step in itertools.chain.from_iterable(rounds):
        if pp > 1:
            send_command(runner, Command.STEP, step.SerializeToString())
        assert not runner.execute(step).error


def _drive_pipelined(driver: PipelineDriver, rounds: list[list[worker_pb2.Step]]) -> None:
    """Each group's next step is launched as soon as its previous one answered: every group in flight."""
    futures: list[Future[worker_pb2.StepResult] | None] = [None] * len(rounds[0])
    for steps in rounds:
        for i, step in enumerate(steps):
            previous = futures[i]
            assert previous is None or not previous.result().error
            futures[i] = driver.launch(step)
    for future in futures:
        assert future is not None and not future.result().error


def run(model: str, mode: Mode, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    per_group = args.batch // (mode.pp if mode.micro_batched else 1)
    num_groups = args.batch // per_group
    groups = []
    first = 0
    for g in range(num_groups):
        groups.append(_Group(f"g{g}", per_group, first, args))
        first += groups[-1].num_blocks
    config = EngineConfig(model_path=model, device="cpu", dtype=args.dtype, pipeline_parallel_size=mode.pp,
                          pipeline_micro_batching=mode.micro_batched, max_num_seqs=args.batch,
                          pp_layer_partition=_partition(args.pp_layer_partition, mode.pp),
                          max_num_batched_tokens=args.batch * args.prompt_len, kv_cache_memory_bytes=1 << 30,
                          max_model_len=args.prompt_len + WARMUP_ROUNDS + args.rounds + 16)  # fmt: skip
    init = DistInit(rank=0, world_size=mode.pp, local_rank=0, init_method=f"tcp://127.0.0.1:{free_port()}")
    context = multiprocessing.get_context("spawn")
    processes: list[BaseProcess] = []
    for rank in range(1, mode.pp):
        dist = DistInit(rank=rank, world_size=mode.pp, local_rank=rank, init_method=init.init_method)
        process = context.Process(target=_follower, args=(config, dist, mode.pp, str(tmp / f"rank{rank}.json")))
        process.start()
        processes.append(process)
    prepare_rank(config, 0, mode.pp, "auto")
    runner = ModelRunner(config, init if mode.pp > 1 else None)
    assert runner.num_blocks >= first, "raise kv_cache_memory_bytes"
    busy: list[Interval] = []
    _record_compute(runner, busy)
    ids = itertools.count(1)
    driver = PipelineDriver(runner, processes, threading.Event()) if mode.micro_batched else None

    def drive(rounds: list[list[worker_pb2.Step]]) -> None:
        if driver is not None:
            _drive_pipelined(driver, rounds)
        else:
            _drive_serial(runner, mode.pp, rounds)

    drive(_rounds(groups, WARMUP_ROUNDS, ids, prefill=True))
    # Measured: decode rounds only, steps built beforehand.
    measured = _rounds(groups, args.rounds, ids, prefill=False)
    window_start = time.perf_counter()
    drive(measured)
    window = (window_start, time.perf_counter())
    if driver is not None:
        driver.close()
    elif mode.pp > 1:
        send_command(runner, Command.SHUTDOWN)
        destroy_groups(runner.ranks)
    for rank_process in processes:
        rank_process.join(120)
        assert rank_process.exitcode == 0, f"rank process exited {rank_process.exitcode}"
    stages = [(0, busy)] + [
        (data["stage"], [tuple(i) for i in data["busy"]])
        for data in (json.loads((tmp / f"rank{r}.json").read_text()) for r in range(1, mode.pp))
    ]
    wall = window[1] - window[0]
    return {
        "mode": mode.name,
        "pp": mode.pp,
        "micro_batched": mode.micro_batched,
        "tokens_per_second": round(args.batch * args.rounds / wall, 1),
        "ms_per_round": round(wall / args.rounds * 1000, 1),
        "stages": [
            {"stage": stage, "busy_fraction": round(_overlap(intervals, window) / wall, 3)}
            for stage, intervals in stages
        ],
    }


def _partition(value: str | None, pp: int) -> tuple[int, ...] | None:
    return None if value is None or pp == 1 else parse_layer_partition(value)


def _overlap(intervals: list[Interval], window: Interval) -> float:
    start, end = window
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=32, help="measured decode rounds (after 4 of warm-up)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--pp-layer-partition", default=None, help="layers per stage, e.g. 17,13 (default: balanced)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from services.worker.model_fetch import ensure_embedded_model

        model = str(ensure_embedded_model())
    report: dict[str, Any] = {"batch": args.batch, "prompt_len": args.prompt_len, "dtype": args.dtype,
                              "rounds": args.rounds, "pp_layer_partition": args.pp_layer_partition,
                              "runs": []}  # fmt: skip
    baseline = None
    for key in args.modes:
        with tempfile.TemporaryDirectory() as tmp:
            figures = run(model, MODES[key], args, Path(tmp))
        baseline = baseline or figures["tokens_per_second"]
        figures["vs_first"] = round(figures["tokens_per_second"] / baseline, 3)
        report["runs"].append(figures)
        print(f"{figures['mode']}: {figures['tokens_per_second']} tok/s, {figures['ms_per_round']} ms a round "
              f"({figures['vs_first']}x {report['runs'][0]['mode']})")  # fmt: skip
        for stage in figures["stages"]:
            print(f"  stage {stage['stage']}: computes {100 * stage['busy_fraction']:.0f}% of the time, "
                  f"waits {100 * (1 - stage['busy_fraction']):.0f}%")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
