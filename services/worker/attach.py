"""The worker's side of Scheduler.Attach: hello, then execute each Step and answer."""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc
import structlog

from services.common.channels import insecure_channel
from services.common.proto.meshserve.v1 import scheduler_pb2_grpc, worker_pb2

log = structlog.get_logger()


class StepExecutor(Protocol):
    """What the attach loop needs from the model runner."""

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult: ...

    def reset(self) -> None: ...


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
    ) -> None:
        self.scheduler_address = scheduler_address
        self.hello = hello
        self.executor = executor
        self.on_attached = on_attached
        self.reconnect_interval = reconnect_interval
        # Always the same thread: OpenMP keeps one thread team per calling thread, and a
        # different pool thread per step would start competing teams on the same cores.
        self._thread = executor_thread
        self._outbox: asyncio.Queue[worker_pb2.WorkerMessage | None] = asyncio.Queue()
        self._stopping = False
        self._attached = False

    async def run(self) -> None:
        """Attach, serve steps, and re-attach after failures until stop() is called."""
        async with insecure_channel(self.scheduler_address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while not self._stopping:
                try:
                    await self._serve_once(stub)
                except grpc.aio.AioRpcError as err:
                    log.warning(
                        "attach stream failed",
                        scheduler=self.scheduler_address,
                        code=err.code().name,
                        details=err.details(),
                    )
                self.executor.reset()
                if self._attached:
                    self._attached = False
                    await self.on_attached(False)
                if not self._stopping:
                    await asyncio.sleep(self.reconnect_interval)

    async def _serve_once(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._outbox = asyncio.Queue()
        self._outbox.put_nowait(worker_pb2.WorkerMessage(hello=self.hello))
        if self._stopping:
            return
        call = stub.Attach(self._messages())
        loop = asyncio.get_running_loop()
        # Steps queued on the model thread, oldest first. With async scheduling the next Step
        # arrives while one runs; queueing it at once lets the thread start it the moment the
        # current one ends, without waiting for this event loop to read it.
        pending: collections.deque[asyncio.Future[worker_pb2.StepResult]] = collections.deque()
        try:
            async for message in call:
                if message.HasField("accepted"):
                    self._attached = True
                    log.info("attached to scheduler", scheduler=self.scheduler_address)
                    await self.on_attached(True)
                elif message.HasField("step"):
                    future = loop.run_in_executor(self._thread, self._execute, message.step)
                    future.add_done_callback(functools.partial(self._answer, pending))
                    pending.append(future)
            log.info("scheduler closed the attach stream")
        finally:
            # The caller resets the runner next; that must not overlap a step still running.
            if pending:
                await asyncio.wait(list(pending))

    def _answer(
        self,
        pending: collections.deque[asyncio.Future[worker_pb2.StepResult]],
        done: asyncio.Future[worker_pb2.StepResult],
    ) -> None:
        """Send results in step order (one model thread runs them in order, so they finish in order)."""
        while pending and pending[0].done():
            future = pending.popleft()
            if not future.cancelled():
                self._outbox.put_nowait(worker_pb2.WorkerMessage(result=future.result()))

    async def _messages(self) -> AsyncIterator[worker_pb2.WorkerMessage]:
        while True:
            message = await self._outbox.get()
            if message is None:
                return
            yield message

    def _execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        start = time.perf_counter()
        try:
            return self.executor.execute(step)
        except Exception as err:  # a bad step must not take the worker down
            log.exception("step failed", step_id=step.step_id)
            return worker_pb2.StepResult(
                step_id=step.step_id,
                error=f"{type(err).__name__}: {err}",
                execute_seconds=time.perf_counter() - start,
            )

    def drain(self, reason: str) -> None:
        """Tell the scheduler to admit nothing new here; it ends the stream once idle."""
        self._stopping = True
        self._outbox.put_nowait(worker_pb2.WorkerMessage(drain=worker_pb2.Drain(reason=reason)))

    def close(self) -> None:
        """End the stream from our side."""
        self._stopping = True
        self._outbox.put_nowait(None)
