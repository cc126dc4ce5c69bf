"""Rank 0 of a worker with pipelined stages: each step is launched on stage 0 and answered when the last
stage's tokens come back, so every stage works on a different micro-batch at once.

launch(step), on the model thread: broadcast the step (with the tokens of the steps answered since the last
command), append those tokens to rank 0's own batch, run stage 0 and hand its activations on. A thread of
its own receives each answer from the sampling rank, in step order, and completes that step's future; the
step's tokens travel to every other rank with the next command (ModelRunner.apply_finished). The scheduler
plans the micro-batches so that no request is in two of them (WorkerHello.step_slots).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import structlog

from services.common.proto.meshserve.v1 import worker_pb2
from services.worker.model_runner import SAMPLING_FAILED, ModelRunner
from services.worker.ranks import Command, Finished, RankDriver, send_command

log = structlog.get_logger()
# How long close() waits for the answer thread once the sampling rank said goodbye.
RECEIVER_JOIN_S = 10.0


@dataclass
class _Launched:
    """A step on the pipeline, waiting for its answer."""

    step_id: int
    started: float
    future: Future[worker_pb2.StepResult] = field(default_factory=Future)
    # Rank 0's own part of the answer (kv fields); set once stage 0 has run it.
    partial: worker_pb2.StepResult | None = None
    ready: threading.Event = field(default_factory=threading.Event)


class PipelineDriver(RankDriver):
    """Rank 0's step executor for pipelined stages: launch() returns the step's future at once."""

    def __init__(self, runner: ModelRunner, processes: list[BaseProcess], stopping: threading.Event) -> None:
        super().__init__(runner, processes, stopping)
        self._lock = threading.Lock()
        # Launched and not yet answered, oldest first; and answered but not yet announced to the other ranks.
        self._waiting: collections.deque[_Launched] = collections.deque()
        self._answered: Finished = []
        self._receiver = threading.Thread(target=self._receive, name="pipeline-answers", daemon=True)
        self._receiver.start()

    @property
    def slots(self) -> int:
        """Steps this worker runs at once: one per stage."""
        return self.runner.stage.num_stages

    def launch(self, step: worker_pb2.Step) -> Future[worker_pb2.StepResult]:
        """Model thread: start the step on the pipeline; its future completes when the last stage answers.

        Raises what the step's checks raise (every rank refuses it alike, and no answer comes for it)."""
        launched = _Launched(step.step_id, time.perf_counter())
        with self._lock:
            finished, self._answered = self._answered, []
            # Registered first: the answer may arrive before runner.execute returns here.
            self._waiting.append(launched)
        try:
            send_command(self.runner, Command.STEP, step.SerializeToString(), finished)
            self.runner.apply_finished(finished)
            launched.partial = self.runner.execute(step)
        except Exception:
            with self._lock:
                self._waiting.remove(launched)
            raise
        launched.ready.set()
        return launched.future

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        """One step start to answer (for callers that do not launch: no other stage works meanwhile)."""
        return self.launch(step).result()

    def reset(self) -> None:
        """Every rank forgets its requests (no step is on the pipeline: the attach loop waited for them)."""
        with self._lock:
            finished, self._answered = self._answered, []
        send_command(self.runner, Command.RESET, finished=finished)
        self.runner.apply_finished(finished)
        self.runner.reset()

    def close(self, timeout: float = 30.0) -> None:
        """Stop every rank; the sampling rank's goodbye ends the answer thread."""
        super().close(timeout)
        self._receiver.join(RECEIVER_JOIN_S)

    def _receive(self) -> None:
        """The answer thread: each step's answer from the sampling rank, in step order."""
        while True:
            try:
                message = self.runner.pipe.recv_result()
            except RuntimeError as err:
                # The group broke (a stage died): nothing launched will be answered.
                self._fail_waiting(err)
                return
            if message is None:
                return
            token_ids, payload = message
            answer = worker_pb2.StepResult.FromString(payload)
            with self._lock:
                launched = self._take(answer.step_id)
                if launched is None:
                    log.error("pipeline_answer_unmatched", step_id=answer.step_id)
                    continue
                self._answered.append((launched.step_id, token_ids))
            launched.ready.wait()
            if SAMPLING_FAILED in token_ids:
                launched.future.set_exception(
                    RuntimeError(f"the sampling rank failed to sample step {launched.step_id}")
                )
                continue
            result = launched.partial
            assert result is not None
            result.sampled.extend(answer.sampled)
            result.execute_seconds = time.perf_counter() - launched.started
            launched.future.set_result(result)

    def _take(self, step_id: int) -> _Launched | None:
        """The launched step this answer is for; a failure's answer names no step and is the oldest's."""
        if not self._waiting:
            return None
        if step_id == 0 or self._waiting[0].step_id == step_id:
            return self._waiting.popleft()
        for launched in self._waiting:
            if launched.step_id == step_id:
                self._waiting.remove(launched)
                return launched
        return None

    def _fail_waiting(self, err: Exception) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for launched in waiting:
            launched.ready.wait(1.0)
            if not launched.future.done():
                launched.future.set_exception(err)
