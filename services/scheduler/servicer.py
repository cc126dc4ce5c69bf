"""The Scheduler gRPC service: Submit streams, worker Attach loops, Abort and stats."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.errors import abort_invalid_argument
from services.common.proto.meshserve.v1 import (
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
)
from services.common.sampling_checks import (
    InvalidField,
    check_prompt_length,
    check_sampling,
    check_token_ids,
    resolve_max_tokens,
)
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Request, RequestStatus
from services.scheduler.settings import SchedulerSettings
from services.scheduler.submissions import Failure, Item, Sink, StreamOut, Submission, is_final
from services.scheduler.waiting_queue import WaitingQueue
from services.scheduler.worker_scheduler import RequestOutput, WorkerScheduler

log = structlog.get_logger()

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: sampling_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: sampling_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: sampling_pb2.FINISH_REASON_ABORT,
}


@dataclass
class _AttachedWorker:
    """One worker's stream and its share of the scheduling state."""

    hello: worker_pb2.WorkerHello
    scheduler: WorkerScheduler
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    draining: bool = False
    closing: bool = False
    gone: bool = False
    # Counter values already exported to Prometheus (the planner keeps running totals).
    exported: tuple[int, int, int] = (0, 0, 0)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Owns the waiting queue, the attached workers and every Submit stream."""

    def __init__(
        self,
        settings: SchedulerSettings,
        metrics: SchedulerMetrics,
        on_ready_change: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.waiting = WaitingQueue()
        self.workers: dict[str, _AttachedWorker] = {}
        self.submissions: dict[str, Submission] = {}
        # Open Stream calls (one per gateway), ended by drain() once their requests are done.
        self.streams: set[StreamOut] = set()
        self.draining = False
        self._on_ready_change = on_ready_change
        self._num_finished = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- helpers -------------------------------------------------------

    @property
    def max_model_len(self) -> int | None:
        """The smallest of the flag and every attached worker's limit."""
        limits = [w.hello.max_model_len for w in self.workers.values()]
        if self.settings.max_model_len:
            limits.append(self.settings.max_model_len)
        return min(limits) if limits else None

    def _wake_all(self) -> None:
        for worker in self.workers.values():
            worker.wake.set()

    async def _ready_changed(self) -> None:
        if self._on_ready_change is not None:
            await self._on_ready_change(bool(self.workers) and not self.draining)

    def _update_gauges(self) -> None:
        self.metrics.num_requests_waiting.set(len(self.waiting))
        self.metrics.num_requests_running.set(sum(w.scheduler.num_running for w in self.workers.values()))
        self.metrics.num_workers.set(len(self.workers))

    def _validate(self, request: scheduler_pb2.SubmitRequest) -> int:
        """Check a submission against the attached workers; returns its resolved max_tokens."""
        if not request.request_id:
            raise InvalidField("request_id", "is empty; the caller must choose a unique id")
        max_model_len = self.max_model_len
        assert max_model_len is not None  # callers check that a worker is attached
        vocab = min(w.hello.vocab_size for w in self.workers.values())
        check_prompt_length(len(request.prompt_token_ids), max_model_len, "prompt_token_ids")
        check_token_ids(request.prompt_token_ids, vocab, "prompt_token_ids")
        check_sampling(request.sampling, vocab)
        max_tokens = resolve_max_tokens(request.sampling, len(request.prompt_token_ids), max_model_len)
        total = len(request.prompt_token_ids) + max_tokens
        if not all(w.scheduler.can_ever_fit(total) for w in self.workers.values()):
            raise InvalidField(
                "sampling.max_tokens",
                f"prompt + max_tokens = {total} tokens do not fit in a worker's KV cache; "
                "lower max_tokens or give workers more --kv-cache-memory",
            )
        return max_tokens

    # ---- Submit / Abort / GetStats ------------------------------------

    def _admit(self, request: scheduler_pb2.SubmitRequest, sink: Sink) -> Submission | Failure:
        """Validate and queue a request whose events go to sink; or why it cannot be queued."""
        if self.draining:
            return Failure(grpc.StatusCode.UNAVAILABLE, "scheduler is draining; retry on another replica")
        if not self.workers:
            return Failure(grpc.StatusCode.UNAVAILABLE, "no worker is attached to the scheduler yet")
        try:
            max_tokens = self._validate(request)
        except InvalidField as err:
            return Failure.invalid(err)
        if request.request_id in self.submissions:
            return Failure(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already running")
        if len(self.waiting) >= self.settings.max_waiting_requests:
            return Failure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.waiting)} requests are waiting (--max-waiting-requests); retry later",
            )
        req = Request(
            request.request_id,
            list(request.prompt_token_ids),
            request.sampling,
            list(request.eos_token_ids),
            max_tokens,
            arrival_time=time.monotonic(),
        )
        sub = Submission(req, sink)
        self.submissions[req.request_id] = sub
        self._idle.clear()
        self.waiting.append(req)
        self._update_gauges()
        self._wake_all()
        log.debug(
            "submitted", request_id=req.request_id, prompt_tokens=len(req.prompt_token_ids), max_tokens=max_tokens
        )
        return sub

    def _release(self, request_id: str) -> None:
        """Forget a submission whose caller is done with it; abort it first if it is still running."""
        sub = self.submissions.get(request_id)
        if sub is None:
            return
        if not sub.finished:
            # The caller went away (or a stop string matched at the gateway).
            self._abort(request_id)
        del self.submissions[request_id]
        if not self.submissions:
            self._idle.set()

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        events: asyncio.Queue[Item] = asyncio.Queue()
        admitted = self._admit(request, lambda _request_id, item: events.put_nowait(item))
        if isinstance(admitted, Failure):
            await admitted.abort(context)
        try:
            while True:
                item = await events.get()
                if isinstance(item, Failure):
                    await item.abort(context)
                yield item
                if is_final(item):
                    return
        finally:
            self._release(request.request_id)

    async def Stream(
        self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.StreamResponse]:
        out = StreamOut(self._release)
        self.streams.add(out)
        reader = asyncio.create_task(self._read_stream(request_iterator, out))
        try:
            while (response := await out.responses.get()) is not None:
                yield response
        finally:
            self.streams.discard(out)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            for request_id in list(out.owned):
                self._release(request_id)

    async def _read_stream(self, requests: AsyncIterator[scheduler_pb2.StreamRequest], out: StreamOut) -> None:
        try:
            async for message in requests:
                if message.HasField("submit"):
                    submit = message.submit
                    # A refusal (ALREADY_EXISTS included) must not release a running request of that id.
                    admitted = self._admit(submit, out.put)
                    if isinstance(admitted, Failure):
                        out.refuse(submit.request_id, admitted)
                    else:
                        out.owned.add(submit.request_id)
                elif message.HasField("abort") and message.abort.request_id in out.owned:
                    out.owned.discard(message.abort.request_id)
                    self._release(message.abort.request_id)
        except grpc.aio.AioRpcError:
            pass
        out.closed = True
        out.end_if_done()

    def _abort(self, request_id: str) -> bool:
        sub = self.submissions.get(request_id)
        if sub is not None:
            sub.finished = True
        found = self.waiting.remove(request_id) is not None
        for worker in self.workers.values():
            if worker.scheduler.abort(request_id) is not None:
                found = True
                worker.wake.set()
        if found:
            self.metrics.request_success.labels(finished_reason="abort").inc()
            log.info("aborted", request_id=request_id)
        self._update_gauges()
        return found

    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortResponse:
        sub = self.submissions.get(request.request_id)
        found = self._abort(request.request_id)
        if sub is not None:
            sub.send(scheduler_pb2.TokenEvent(finish_reason=sampling_pb2.FINISH_REASON_ABORT))
        return scheduler_pb2.AbortResponse(found=found)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        out = scheduler_pb2.SchedulerStats(num_waiting=len(self.waiting))
        for worker_id, worker in self.workers.items():
            s = worker.scheduler.stats()
            out.num_running += s.num_running
            out.num_steps += s.num_steps
            out.num_mixed_steps += s.num_mixed_steps
            out.max_batch_size = max(out.max_batch_size, s.max_batch_size)
            out.num_preemptions += s.num_preemptions
            out.prefix_cache_queries += s.prefix_cache_queries
            out.prefix_cache_hits += s.prefix_cache_hits
            out.workers.append(
                scheduler_pb2.WorkerPoolStats(
                    worker_id=worker_id,
                    num_blocks=s.num_blocks,
                    num_free_blocks=s.num_free_blocks,
                    num_cached_blocks=s.num_cached_blocks,
                    num_running=s.num_running,
                )
            )
        out.num_finished = self._num_finished
        return out

    # ---- Attach ----------------------------------------------------------

    async def Attach(
        self, request_iterator: AsyncIterator[worker_pb2.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SchedulerMessage]:
        messages = request_iterator.__aiter__()
        try:
            first = await anext(messages)
        except StopAsyncIteration:
            return
        if not first.HasField("hello"):
            await abort_invalid_argument(context, "hello", "the first message on Attach must be a WorkerHello")
        hello = first.hello
        try:
            self._check_hello(hello)
        except InvalidField as err:
            await abort_invalid_argument(context, f"hello.{err.field}", err.description)
        worker = _AttachedWorker(
            hello=hello,
            scheduler=WorkerScheduler(
                worker_id=hello.worker_id,
                num_blocks=hello.num_blocks,
                block_size=hello.block_size,
                max_num_seqs=min(self.settings.max_num_seqs, hello.max_num_seqs or self.settings.max_num_seqs),
                max_num_batched_tokens=min(
                    self.settings.max_num_batched_tokens,
                    hello.max_num_batched_tokens or self.settings.max_num_batched_tokens,
                ),
                max_model_len=min(hello.max_model_len, self.settings.max_model_len or hello.max_model_len),
                enable_prefix_caching=self.settings.enable_prefix_caching,
                waiting=self.waiting,
            ),
        )
        self.workers[hello.worker_id] = worker
        log.info(
            "worker attached",
            worker_id=hello.worker_id,
            device=hello.device,
            model=hello.model_name,
            num_blocks=hello.num_blocks,
            block_size=hello.block_size,
        )
        await self._ready_changed()
        self._update_gauges()
        results: asyncio.Queue[worker_pb2.StepResult | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read_worker(messages, worker, results))
        try:
            yield worker_pb2.SchedulerMessage(accepted=worker_pb2.AttachAccepted(worker_id=hello.worker_id))
            async for message in self._step_loop(worker, results):
                yield message
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await self._detach(worker)

    def _check_hello(self, hello: worker_pb2.WorkerHello) -> None:
        if not hello.worker_id:
            raise InvalidField("worker_id", "is empty")
        if hello.worker_id in self.workers:
            raise InvalidField("worker_id", f"{hello.worker_id!r} is already attached; use a unique id")
        for name in ("block_size", "num_blocks", "max_model_len", "vocab_size"):
            if getattr(hello, name) <= 0:
                raise InvalidField(name, "must be > 0")
        identities = {w.hello.model_identity for w in self.workers.values()}
        if identities and hello.model_identity not in identities:
            raise InvalidField(
                "model_identity",
                "differs from the attached workers' model; run one model per scheduler",
            )

    async def _read_worker(
        self,
        messages: AsyncIterator[worker_pb2.WorkerMessage],
        worker: _AttachedWorker,
        results: asyncio.Queue[worker_pb2.StepResult | None],
    ) -> None:
        try:
            async for message in messages:
                if message.HasField("drain"):
                    log.info("worker draining", worker_id=worker.hello.worker_id, reason=message.drain.reason)
                    worker.draining = True
                    worker.scheduler.accepting = False
                    worker.wake.set()
                elif message.HasField("result"):
                    results.put_nowait(message.result)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            worker.gone = True
            results.put_nowait(None)
            worker.wake.set()

    async def _step_loop(
        self, worker: _AttachedWorker, results: asyncio.Queue[worker_pb2.StepResult | None]
    ) -> AsyncIterator[worker_pb2.SchedulerMessage]:
        ws = worker.scheduler
        # Steps sent and not yet answered; with async scheduling the next one goes out while one runs.
        in_flight: collections.deque[worker_pb2.Step] = collections.deque()
        depth = 2 if self.settings.async_scheduling else 1
        while not worker.gone:
            if not in_flight and (worker.closing or (worker.draining and ws.num_running == 0)):
                return
            worker.wake.clear()
            step = ws.schedule() if len(in_flight) < depth and not worker.closing else None
            if step is not None:
                self.metrics.iteration_tokens.observe(
                    sum(r.num_scheduled_tokens for r in step.new_requests)
                    + sum(r.num_scheduled_tokens for r in step.scheduled)
                )
                in_flight.append(step)
                yield worker_pb2.SchedulerMessage(step=step)
                continue
            if not in_flight:
                await worker.wake.wait()
                continue
            result = await results.get()
            if result is None:
                return
            step = in_flight.popleft()
            if result.step_id != step.step_id:
                log.error("step id mismatch", expected=step.step_id, got=result.step_id)
                return
            self.metrics.step_seconds.observe(result.execute_seconds)
            outputs = ws.update(step, result)
            if result.error:
                log.error("step failed on worker", worker_id=worker.hello.worker_id, error=result.error)
                for later in in_flight:
                    outputs += ws.fail_step(later, f"an earlier step failed: {result.error}")
            self._dispatch(outputs)
            self._update_gauges()
            self._export_counters(worker)

    def _export_counters(self, worker: _AttachedWorker) -> None:
        stats = worker.scheduler.stats()
        self.metrics.kv_cache_usage_perc.labels(worker=worker.hello.worker_id).set(stats.kv_cache_usage)
        totals = (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits)
        preempted, queries, hits = (now - before for now, before in zip(totals, worker.exported, strict=True))
        worker.exported = totals
        self.metrics.num_preemptions.inc(preempted)
        self.metrics.prefix_cache_queries.inc(queries)
        self.metrics.prefix_cache_hits.inc(hits)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            req = out.request
            sub = self.submissions.get(req.request_id)
            if sub is None or sub.finished:
                continue
            if out.error is not None:
                sub.finished = True
                sub.send(Failure(grpc.StatusCode.INTERNAL, f"the worker failed: {out.error}"))
                continue
            event = scheduler_pb2.TokenEvent(token_ids=out.new_token_ids)
            if req.sampling.logprobs:
                event.logprobs.extend(out.new_logprobs)
            if sub.first_token_at is None and out.new_token_ids:
                sub.first_token_at = now
                event.num_cached_tokens = req.num_cached_tokens
                if req.arrival_time is not None:
                    self.metrics.time_to_first_token.observe(now - req.arrival_time)
            if out.finish_reason is not None:
                event.finish_reason = _FINISH_REASONS[out.finish_reason]
                if req.stop_token_id is not None:
                    event.stop_token_id = req.stop_token_id
                sub.finished = True
                self._num_finished += 1
                reason = sampling_pb2.FinishReason.Name(event.finish_reason).removeprefix("FINISH_REASON_")
                self.metrics.request_success.labels(finished_reason=reason.lower()).inc()
                if req.arrival_time is not None:
                    self.metrics.e2e_request_latency.observe(now - req.arrival_time)
            sub.send(event)

    async def _detach(self, worker: _AttachedWorker) -> None:
        worker_id = worker.hello.worker_id
        self.workers.pop(worker_id, None)
        orphans = worker.scheduler.drain_requests()
        for req in reversed(orphans):
            if req.request_id in self.submissions:
                self.waiting.prepend(req)
        if orphans:
            self.metrics.num_preemptions.inc(len(orphans))
        log.info("worker detached", worker_id=worker_id, requeued=len(orphans))
        with contextlib.suppress(KeyError):
            self.metrics.kv_cache_usage_perc.remove(worker_id)
        if not self.workers and not self.draining:
            # Without any worker the queue can never drain: fail rather than hang.
            self._fail_waiting("the last worker detached; no worker can run this request")
        self._wake_all()
        self._update_gauges()
        await self._ready_changed()

    def _fail_waiting(self, message: str) -> None:
        while len(self.waiting):
            req = self.waiting.popleft()
            sub = self.submissions.get(req.request_id)
            if sub is not None:
                sub.finished = True
                sub.send(Failure(grpc.StatusCode.UNAVAILABLE, message))

    # ---- shutdown --------------------------------------------------------

    async def drain(self, grace: float) -> None:
        """Refuse new work, let running requests finish, then release the workers."""
        self.draining = True
        await self._ready_changed()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, grace - 1.0))
        # A gateway's stream never ends by itself; the server's graceful stop would wait out the grace on it.
        for out in list(self.streams):
            out.closed = True
            out.end_if_done()
        for worker in self.workers.values():
            worker.closing = True
            worker.wake.set()
