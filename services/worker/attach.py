"""The worker's side of Scheduler.Attach: hello, then execute each Step and answer, with heartbeats."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import os
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import grpc
import structlog

from services.common.channels import open_channel
from services.common.proto.meshserve.v1 import scheduler_pb2_grpc, worker_pb2
from services.common.tls import Security

log = structlog.get_logger()

# Used when AttachAccepted carries no interval (a scheduler that predates heartbeats ignores them).
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
# Test-only fault injection, read by with_test_faults() and nowhere else.
HANG_AFTER_STEPS_ENV = "MESHSERVE_TEST_HANG_AFTER_STEPS"

Outbox = asyncio.Queue[worker_pb2.WorkerMessage | None]


class StepExecutor(Protocol):
    """What the attach loop needs from the model runner."""

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult: ...

    def reset(self) -> None: ...


@runtime_checkable
class PipelinedExecutor(StepExecutor, Protocol):
    """An executor whose steps overlap (pipelined stages): launch starts one on the model thread and returns
    the future of its answer, so the next step can start before this one is answered."""

    def launch(self, step: worker_pb2.Step) -> Future[worker_pb2.StepResult]: ...


class StepRejected(ValueError):
    """An executor refuses a step because of one request in it (the scheduler's view and the worker's differ):
    the step's result carries the error, and the log line names the request and its trace."""

    def __init__(self, request_id: str, message: str, trace_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.trace_id = trace_id


class ModelThreadHung(RuntimeError):
    """A step kept running long after its stream ended: only a new process recovers the engine."""


def heartbeat_interval(accepted: worker_pb2.AttachAccepted) -> float:
    """Seconds between heartbeats: the scheduler's ask, or our default when it names none."""
    interval = accepted.heartbeat_interval_seconds
    return interval if interval > 0 else DEFAULT_HEARTBEAT_INTERVAL_S


class AttachClient:
    """Keeps one worker attached to the scheduler, reconnecting when the stream breaks."""

    def __init__(
        self,
        scheduler_address: str,
        hello: worker_pb2.WorkerHello,
        executor: StepExecutor,
        on_attached: Callable[[bool], Awaitable[None]],
        executor_thread: ThreadPoolExecutor,
        reconnect_interval: float = 1.0,
        *,
        hung_step_timeout: float,
        security: Security | None = None,
    ) -> None:
        self.scheduler_address = scheduler_address
        # TLS and internal token of the Attach channel (None: insecure).
        self.security = security
        self.hello = hello
        self.executor = executor
        # Decided once: a runtime-checkable Protocol's isinstance walks its members, too slow for every step.
        self._pipelined: PipelinedExecutor | None = executor if isinstance(executor, PipelinedExecutor) else None
        self.on_attached = on_attached
        self.reconnect_interval = reconnect_interval
        self.hung_step_timeout = hung_step_timeout
        # Always the same thread: OpenMP keeps one thread team per calling thread, and a
        # different pool thread per step would start competing teams on the same cores.
        self._thread = executor_thread
        self._outbox: Outbox = asyncio.Queue()
        # Steps received and not yet answered, oldest first; the model thread runs them in this order.
        self._pending: collections.deque[asyncio.Future[worker_pb2.StepResult]] = collections.deque()
        # (step_id, monotonic start) of the step on the model thread, None between steps. Written there
        # as one assignment and only read on the event loop, so heartbeats need no lock.
        self._running: tuple[int, float] | None = None
        self._model_thread_id: int | None = None
        self._stop = asyncio.Event()
        self._attached = False

    async def run(self) -> None:
        """Attach, serve steps, and re-attach after failures until drain() or close().

        Raises ModelThreadHung when a step is still running hung_step_timeout after its stream ended.
        """
        async with open_channel(self.scheduler_address, self.security) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while not self._stop.is_set():
                await self._attach_once(stub)
                await self._set_attached(False)
                if not await self.wait_steps_done(self.hung_step_timeout):
                    raise ModelThreadHung(self._report_hang())
                # The next stream starts from an empty batch; reset on the model thread, after its steps.
                await asyncio.get_running_loop().run_in_executor(self._thread, self.executor.reset)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=self.reconnect_interval)

    async def _attach_once(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        """One Attach stream, from hello until either side ends it."""
        outbox: Outbox = asyncio.Queue()
        outbox.put_nowait(worker_pb2.WorkerMessage(hello=self.hello))
        self._outbox = outbox
        call = stub.Attach(_messages(outbox))
        heartbeats: asyncio.Task[None] | None = None
        try:
            async for message in call:
                if message.HasField("accepted"):
                    interval = heartbeat_interval(message.accepted)
                    heartbeats = heartbeats or asyncio.create_task(self._send_heartbeats(outbox, interval))
                    log.info("attached to scheduler", scheduler=self.scheduler_address, heartbeat_interval_s=interval)
                    await self._set_attached(True)
                elif message.HasField("step"):
                    self._submit(outbox, message.step)
            log.info("scheduler closed the attach stream", pending_steps=len(self._pending))
        except grpc.aio.AioRpcError as err:
            log.warning(
                "attach stream failed",
                scheduler=self.scheduler_address,
                code=err.code().name,
                details=err.details(),
                pending_steps=len(self._pending),
            )
        finally:
            if heartbeats is not None:
                heartbeats.cancel()
            # End our request iterator too: grpc leaves its reader task waiting on the outbox otherwise.
            outbox.put_nowait(None)
            call.cancel()

    def _submit(self, outbox: Outbox, step: worker_pb2.Step) -> None:
        """Queue the step on the model thread at once: with async scheduling the next Step arrives while
        one runs, and the thread starts it the moment the current one ends, without waiting for this loop."""
        future: asyncio.Future[worker_pb2.StepResult]
        if self._pipelined is not None:
            future = asyncio.ensure_future(self._run_launched(step))
        else:
            # In a copy of this context, so the model thread's log lines carry the worker's bound fields.
            run = functools.partial(contextvars.copy_context().run, self._execute, step)
            future = asyncio.get_running_loop().run_in_executor(self._thread, run)
        future.add_done_callback(functools.partial(self._answer, outbox))
        self._pending.append(future)

    async def _run_launched(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        """A pipelined step: launched on the model thread in arrival order, answered when its future is."""
        start = time.monotonic()
        run = functools.partial(contextvars.copy_context().run, self._launch, step)
        try:
            answer = await asyncio.get_running_loop().run_in_executor(self._thread, run)
            return await asyncio.wrap_future(answer)
        except Exception as err:  # a bad step must not take the worker down
            return self._failed(step, err, start)

    def _launch(self, step: worker_pb2.Step) -> Future[worker_pb2.StepResult]:
        """Run on the model thread: the step's stage-0 part."""
        assert self._pipelined is not None
        self._model_thread_id = threading.get_ident()
        self._running = (step.step_id, time.monotonic())
        try:
            return self._pipelined.launch(step)
        finally:
            self._running = None

    def _answer(self, outbox: Outbox, done: asyncio.Future[worker_pb2.StepResult]) -> None:
        """Send results in step order (one model thread runs them in order, so they finish in order)."""
        while self._pending and self._pending[0].done():
            future = self._pending.popleft()
            if not future.cancelled():
                outbox.put_nowait(worker_pb2.WorkerMessage(result=future.result()))

    async def _send_heartbeats(self, outbox: Outbox, interval: float) -> None:
        """From the event loop, never the model thread: a long step must not look like a dead worker."""
        while True:
            await asyncio.sleep(interval)
            outbox.put_nowait(worker_pb2.WorkerMessage(heartbeat=self._heartbeat()))

    def _heartbeat(self) -> worker_pb2.Heartbeat:
        """How busy the model thread is right now."""
        running = self._running
        seconds = 0.0 if running is None else time.monotonic() - running[1]
        return worker_pb2.Heartbeat(num_pending_steps=len(self._pending), running_step_seconds=seconds)

    def _execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        """Run on the model thread."""
        self._model_thread_id = threading.get_ident()
        start = time.monotonic()
        self._running = (step.step_id, start)
        try:
            return self.executor.execute(step)
        except Exception as err:  # a bad step must not take the worker down
            return self._failed(step, err, start)
        finally:
            self._running = None

    @staticmethod
    def _failed(step: worker_pb2.Step, err: Exception, start: float) -> worker_pb2.StepResult:
        """The answer of a step that raised: logged with the request it names, if any."""
        if isinstance(err, StepRejected):
            log.error(
                "step failed",
                step_id=step.step_id,
                request_id=err.request_id,
                trace_id=err.trace_id,
                exc_info=err,
            )
        else:
            log.error("step failed", step_id=step.step_id, exc_info=err)
        return worker_pb2.StepResult(
            step_id=step.step_id,
            error=f"{type(err).__name__}: {err}",
            execute_seconds=time.monotonic() - start,
        )

    async def wait_steps_done(self, timeout: float) -> bool:
        """Wait up to timeout for every step the model thread holds; False when one is still running."""
        if self._pending:
            _, running = await asyncio.wait(list(self._pending), timeout=timeout)
            if running:
                return False
        self._pending.clear()
        return True

    def _report_hang(self) -> str:
        """Log where the model thread is stuck (what an operator needs to file the bug) and say why we stop."""
        running = self._running
        step_id, seconds = (None, 0.0) if running is None else (running[0], time.monotonic() - running[1])
        frame = sys._current_frames().get(self._model_thread_id or 0)
        log.error(
            "model thread hung: a step outlived its attach stream; the worker must restart",
            step_id=step_id,
            running_step_seconds=round(seconds, 3),
            pending_steps=len(self._pending),
            hung_step_timeout_s=self.hung_step_timeout,
            model_thread_stack="".join(traceback.format_stack(frame)) if frame is not None else "",
        )
        return f"step {step_id} still running after {seconds:.1f}s, {self.hung_step_timeout:g}s after its stream ended"

    async def _set_attached(self, attached: bool) -> None:
        if attached != self._attached:
            self._attached = attached
            await self.on_attached(attached)

    def drain(self, reason: str) -> None:
        """Tell the scheduler to admit nothing new here; it ends the stream once our requests finished.

        Steps and heartbeats go on until then; no re-attach follows."""
        log.info("draining: the scheduler finishes our requests, then ends the stream", reason=reason)
        self._stop.set()
        self._outbox.put_nowait(worker_pb2.WorkerMessage(drain=worker_pb2.Drain(reason=reason)))

    def close(self) -> None:
        """End the stream from our side; the scheduler re-queues whatever still ran here."""
        self._stop.set()
        self._outbox.put_nowait(None)


async def _messages(outbox: Outbox) -> AsyncIterator[worker_pb2.WorkerMessage]:
    """The request side of one Attach stream; None ends it."""
    while True:
        message = await outbox.get()
        if message is None:
            return
        yield message


class HangAfterSteps:
    """TEST-ONLY fault: runs `steps` steps, then blocks the model thread forever on the next one.

    Integration tests arm it with MESHSERVE_TEST_HANG_AFTER_STEPS=N to get a worker that is alive
    but stuck, like an engine wedged in a device call: the event loop and heartbeats go on, the step
    never answers. Never armed in production.
    """

    def __init__(self, inner: StepExecutor, steps: int) -> None:
        self.inner = inner
        self.steps_left = steps
        # Set when the model thread blocks, so a test can see the fault took effect.
        self.hanging = threading.Event()
        self._never = threading.Event()

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        if self.steps_left == 0:
            log.warning("test fault: the model thread hangs now", step_id=step.step_id)
            self.hanging.set()
            self._never.wait()
        self.steps_left -= 1
        return self.inner.execute(step)

    def reset(self) -> None:
        self.inner.reset()

    def release(self) -> None:
        """Unblock the model thread: in-process unit tests must not leave a blocked thread behind."""
        self._never.set()


def with_test_faults(executor: StepExecutor, environ: Mapping[str, str] = os.environ) -> StepExecutor:
    """The executor, wrapped in the test-only fault HANG_AFTER_STEPS_ENV asks for (unset: unchanged)."""
    value = environ.get(HANG_AFTER_STEPS_ENV, "").strip()
    if not value:
        return executor
    steps = int(value)
    log.warning("test fault armed: the model thread will hang", env=HANG_AFTER_STEPS_ENV, after_steps=steps)
    return HangAfterSteps(executor, steps)
