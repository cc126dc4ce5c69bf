"""A worker's ranks: the node's first process starts the others; rank 0 sends every rank each command.

Rank 0 is the worker attached to the scheduler. Before running a Step itself it broadcasts the Step
(serialized) over the gloo command channel; every other rank runs the same Step on its shard (or its
pipeline stage), so the collectives and stage-to-stage hops inside the forward pair up. The sampling
rank (rank 0, or the last stage's first rank) samples; one step at a time it broadcasts the tokens. With
pipelined stages a command also carries the tokens of the steps answered since the last one
(services/worker/pipeline_driver.py), and each rank takes commands on a thread of its own, so rank 0's
broadcast never waits for a stage busy with an earlier step.
"""

from __future__ import annotations

import ctypes
import enum
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import structlog
import torch

from services.common.logs import configure_logging
from services.common.proto.meshserve.v1 import worker_pb2
from services.worker.attach import StepRejected
from services.worker.cpu_binding import apply_binding, format_cpulist
from services.worker.distributed import DistInit, destroy_groups
from services.worker.engine_config import EngineConfig
from services.worker.host_allocator import retain_freed_memory
from services.worker.model_runner import ModelRunner
from services.worker.startup_error import StartupError

log = structlog.get_logger()
_PR_SET_PDEATHSIG = 1


class Command(enum.IntEnum):
    """What rank 0 tells the other ranks to do next."""

    STEP = 1
    RESET = 2
    SHUTDOWN = 3


@dataclass(frozen=True)
class RankSpec:
    """Everything a spawned rank needs (pickled across the spawn)."""

    config: EngineConfig
    dist: DistInit
    ranks_per_node: int
    cpu_binding: str
    log_level: str
    log_format: str


def prepare_rank(config: EngineConfig, local_rank: int, ranks_per_node: int, cpu_binding: str) -> None:
    """Pin the rank to its CPUs, size its thread pool (before torch starts any threads) and keep the host
    allocator's freed memory for the next step."""
    retain_freed_memory()
    device = config.device
    binding = apply_binding(cpu_binding, device_type=device, local_rank=local_rank, ranks_per_node=ranks_per_node)
    log.info("cpu_binding", cpus=format_cpulist(binding.cpus), source=binding.source, reason=binding.reason)
    if ranks_per_node > 1 and device == "cpu":
        # Ranks on one host would otherwise each start a thread per core and fight over them.
        allowed = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, allowed if binding.cpus else allowed // ranks_per_node))


# Steps answered since the previous command, each (step_id, the sampled id of every row it sampled).
Finished = list[tuple[int, list[int]]]


def send_command(
    runner: ModelRunner, command: Command, payload: bytes = b"", finished: Sequence[tuple[int, Sequence[int]]] = ()
) -> None:
    """Rank 0: tell every other rank what to do next (and, pipelined, which steps were answered with what)."""
    answered = [v for step_id, ids in finished for v in (step_id, len(ids), *ids)]
    runner.ranks.broadcast_ints([int(command), len(payload), len(answered)], 3)
    runner.ranks.broadcast_bytes(payload, len(payload))
    if answered:
        runner.ranks.broadcast_ints(answered, len(answered))


def receive_command(runner: ModelRunner) -> tuple[int, bytes, Finished]:
    """A non-zero rank: rank 0's next command, its payload and the steps it says were answered."""
    kind, length, count = runner.ranks.broadcast_ints(None, 3)
    payload = runner.ranks.broadcast_bytes(None, length)
    answered = runner.ranks.broadcast_ints(None, count) if count else []
    finished: Finished = []
    i = 0
    while i < len(answered):
        step_id, n = answered[i], answered[i + 1]
        finished.append((step_id, answered[i + 2 : i + 2 + n]))
        i += 2 + n
    return kind, payload, finished


def serve_commands(runner: ModelRunner) -> None:
    """A non-zero rank: run rank 0's commands until it says shut down (or the group breaks)."""
    if runner.pipelined:
        _serve_pipelined(runner)
        return
    while True:
        kind, payload, _ = receive_command(runner)
        if kind == Command.SHUTDOWN:
            return
        if kind == Command.RESET:
            runner.reset()
            continue
        _run_step(runner, payload)


def _run_step(runner: ModelRunner, payload: bytes) -> None:
    step = worker_pb2.Step.FromString(payload)
    try:
        runner.execute(step)
    except ValueError as err:
        # Rank 0 validated the same step against the same state and reports the error upstream.
        named = {"request_id": err.request_id, "trace_id": err.trace_id} if isinstance(err, StepRejected) else {}
        log.debug("step_rejected", step_id=step.step_id, error=str(err), **named)


def _serve_pipelined(runner: ModelRunner) -> None:
    """Pipelined stages: a thread takes rank 0's commands as they come (so its broadcast never waits on this
    rank's forward of an earlier step); this thread runs them in order. The queue holds at most the steps
    the scheduler keeps in flight (one per stage)."""
    commands: queue.Queue[tuple[int, bytes, Finished] | RuntimeError] = queue.Queue()

    def listen() -> None:
        while True:
            try:
                command = receive_command(runner)
            except RuntimeError as err:
                commands.put(err)
                return
            commands.put(command)
            if command[0] == Command.SHUTDOWN:
                return

    threading.Thread(target=listen, name="pipeline-commands", daemon=True).start()
    while True:
        item = commands.get()
        if isinstance(item, RuntimeError):
            raise item
        kind, payload, finished = item
        if kind == Command.SHUTDOWN:
            if runner.samples:
                # Rank 0's answer thread waits on this rank: let it end.
                runner.pipe.send_result(None)
            return
        runner.apply_finished(finished)
        if kind == Command.RESET:
            runner.reset()
        else:
            _run_step(runner, payload)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (rank 0's process) dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return


def follower_main(spec: RankSpec) -> None:
    """Entry point of a spawned rank: bind, load the shard, serve commands."""
    _die_with_parent()
    # SIGINT goes to the whole process group on Ctrl-C; rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging("worker", spec.log_level, spec.log_format)
    structlog.contextvars.bind_contextvars(tp_rank=spec.dist.rank)
    try:
        prepare_rank(spec.config, spec.dist.local_rank, spec.ranks_per_node, spec.cpu_binding)
        runner = ModelRunner(spec.config, spec.dist)
    except (StartupError, ValueError) as err:
        log.error("startup_failed", error=str(err))
        sys.exit(1)
    try:
        serve_commands(runner)
    except RuntimeError as err:
        # The group broke (rank 0 or a peer died): nothing left to serve.
        log.error("tensor_parallel_group_failed", error=str(err))
        sys.exit(1)
    finally:
        # The kvstore threads and this rank's shared-memory outbox first (it would outlive the process).
        runner.close()
        destroy_groups(runner.ranks)


def spawn_local_ranks(spec: RankSpec, first_rank: int) -> list[BaseProcess]:
    """Start this node's ranks first_rank+1 .. first_rank+ranks_per_node-1 as processes."""
    context = multiprocessing.get_context("spawn")
    processes: list[BaseProcess] = []
    for local in range(1, spec.ranks_per_node):
        dist = DistInit(
            rank=first_rank + local,
            world_size=spec.dist.world_size,
            local_rank=local,
            init_method=spec.dist.init_method,
        )
        rank_spec = RankSpec(spec.config, dist, spec.ranks_per_node, spec.cpu_binding, spec.log_level, spec.log_format)
        process = context.Process(target=follower_main, args=(rank_spec,), name=f"tp-rank-{dist.rank}", daemon=True)
        process.start()
        processes.append(process)
    return processes


def watch_ranks(processes: list[BaseProcess], stopping: threading.Event) -> threading.Thread:
    """A thread that ends this process if a rank dies unasked: the group cannot run steps without it."""

    def watch() -> None:
        sentinels = {p.sentinel: p for p in processes}
        while sentinels and not stopping.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=1.0)
            for sentinel in ready:
                process = sentinels.pop(sentinel)  # type: ignore[arg-type]
                if not stopping.is_set():
                    log.error("tensor_parallel_rank_died", rank=process.name, exitcode=process.exitcode)
                    # Collectives on the other ranks would hang; the orchestrator restarts the worker
                    # and the scheduler re-queues its requests when the attach stream breaks.
                    os._exit(1)

    thread = threading.Thread(target=watch, name="tp-rank-watch", daemon=True)
    thread.start()
    return thread


class RankDriver:
    """Rank 0's step executor: every command goes to the other ranks first, then runs here."""

    def __init__(self, runner: ModelRunner, processes: list[BaseProcess], stopping: threading.Event) -> None:
        self.runner = runner
        self.processes = processes
        self._stopping = stopping

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        """Broadcast the step, then run rank 0's part (which samples)."""
        send_command(self.runner, Command.STEP, step.SerializeToString())
        return self.runner.execute(step)

    def reset(self) -> None:
        """Every rank forgets its requests."""
        send_command(self.runner, Command.RESET)
        self.runner.reset()

    def close(self, timeout: float = 30.0) -> None:
        """Tell every rank to stop, wait for this node's, leave the group."""
        self._stopping.set()
        try:
            send_command(self.runner, Command.SHUTDOWN)
        except RuntimeError as err:
            log.warning("tensor_parallel_shutdown_failed", error=str(err))
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
        destroy_groups(self.runner.ranks)
