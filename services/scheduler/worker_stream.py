"""The async side of one Attach stream: read the worker's messages, send it steps, watch its health."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from services.common.proto.meshserve.v1 import worker_pb2
from services.scheduler.cluster import Cluster
from services.scheduler.engine import StepProtocolError, WorkerLoop, WorkerState

log = structlog.get_logger()

# The stream reader's verdicts, besides a StepResult.
_ENDED = "the worker ended its stream"


class WorkerStream:
    """Drives one attached worker until it leaves, is lost, or the scheduler closes."""

    def __init__(self, cluster: Cluster, worker: WorkerLoop) -> None:
        self.cluster = cluster
        self.worker = worker
        self._results: asyncio.Queue[worker_pb2.StepResult | str] = asyncio.Queue()
        # Why the worker is lost, once it is; None while healthy or after a clean leave.
        self.lost_reason: str | None = None

    async def read(self, messages: AsyncIterator[worker_pb2.WorkerMessage]) -> None:
        """Consume the worker's messages (run as a task beside steps())."""
        worker = self.worker
        try:
            async for message in messages:
                worker.heard_from(time.monotonic())
                kind = message.WhichOneof("kind")
                if kind == "result":
                    self._results.put_nowait(message.result)
                elif kind == "drain":
                    self.cluster.begin_drain(worker, message.drain.reason)
                    await self.cluster.publish_readiness()
                # A heartbeat only proves the worker's event loop is alive: heard_from above is all it does.
        except grpc.aio.AioRpcError as err:
            self._results.put_nowait(f"stream failed: {err.code().name}")
            return
        self._results.put_nowait(_ENDED)

    async def steps(self) -> AsyncIterator[worker_pb2.SchedulerMessage]:
        """The Step messages to send, until the worker leaves or is lost."""
        worker, settings = self.worker, self.cluster.settings
        pending: asyncio.Task[worker_pb2.StepResult | str] | None = None
        try:
            while True:
                now = time.monotonic()
                if self._should_end():
                    return
                worker.wake.clear()
                step = worker.plan(now)
                if step is not None:
                    tokens = sum(r.num_scheduled_tokens for r in step.new_requests) + sum(
                        r.num_scheduled_tokens for r in step.scheduled
                    )
                    self.cluster.metrics.iteration_tokens.observe(tokens)
                    yield worker_pb2.SchedulerMessage(step=step)
                    continue
                if pending is None:
                    pending = asyncio.ensure_future(self._results.get())
                waits: set[asyncio.Future[object]] = {pending}  # type: ignore[arg-type]
                woken: asyncio.Task[bool] | None = None
                if worker.num_in_flight < worker.depth:
                    # Room for another step: a new arrival (wake) may give it work.
                    woken = asyncio.ensure_future(worker.wake.wait())
                    waits.add(woken)  # type: ignore[arg-type]
                timeout = worker.next_check_in(now, settings.worker_heartbeat_timeout, settings.step_timeout)
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if woken is not None and not woken.done():
                    woken.cancel()
                if pending in done:
                    item = pending.result()
                    pending = None
                    if isinstance(item, str):
                        if not (worker.state is WorkerState.DRAINING and worker.is_idle):
                            self.lost_reason = item
                        return
                    if not self._apply(item):
                        return
                elif not done:
                    reason = worker.stuck_reason(
                        time.monotonic(), settings.worker_heartbeat_timeout, settings.step_timeout
                    )
                    if reason is not None:
                        log.error("worker stuck", worker_id=worker.worker_id, reason=reason)
                        self.lost_reason = reason
                        return
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending

    def _apply(self, result: worker_pb2.StepResult) -> bool:
        worker = self.worker
        try:
            outputs = worker.apply(result, time.monotonic())
        except StepProtocolError as err:
            log.error("step protocol error", worker_id=worker.worker_id, error=str(err))
            self.lost_reason = f"protocol error: {err}"
            return False
        if result.error:
            log.error("step failed on worker", worker_id=worker.worker_id, error=result.error)
        self.cluster.dispatch(outputs)
        return True

    def loss(self) -> str | None:
        """Why the worker counts as lost now that its stream is over; None for a clean leave."""
        if self.lost_reason is not None:
            return self.lost_reason
        if self._should_end():
            return None
        # The call ended under us (the worker's connection dropped and grpc cancelled the handler).
        return "stream cancelled"

    def _should_end(self) -> bool:
        worker = self.worker
        if self.cluster.closing:
            return worker.num_in_flight == 0
        return worker.state is WorkerState.DRAINING and worker.is_idle
