"""The scheduler's whole state: the worker registry, the router, every submission, requeue and timers.

No gRPC here beyond status codes: the servicer hands messages in and streams what this decides out.
Three different ways work leaves a worker, kept apart by name:
- begin_drain: the worker is leaving (its SIGTERM); its queued requests move now, running ones finish.
- detach(lost=...): the worker is gone or declared stuck; everything it held is requeued elsewhere.
- shutdown: the scheduler itself stops; new work is refused, running work gets the grace period.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import structlog

from services.common.engine_defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from services.common.errors import Reason
from services.common.proto.meshserve.v1 import scheduler_pb2, worker_pb2
from services.common.sampling_checks import InvalidField
from services.common.tracing import Tracing
from services.scheduler.admission import ModelLimits, admit
from services.scheduler.engine import MAX_STEP_SLOTS, WorkerLoop, WorkerState
from services.scheduler.kv_lookup import KVStoreLookup
from services.scheduler.metrics import SchedulerMetrics, WorkerMetrics
from services.scheduler.outputs import OutputProcessor
from services.scheduler.request import Request
from services.scheduler.request_log import RequestLog
from services.scheduler.router import RoutingPolicy, choose_worker
from services.scheduler.settings import SchedulerSettings
from services.scheduler.submissions import Failure, Sink, Submission
from services.scheduler.waiting_queue import WaitingQueue
from services.scheduler.worker_scheduler import KVStoreUse, RequestOutput

log = structlog.get_logger()


class Cluster:
    """Workers, their queues and every request in flight."""

    def __init__(
        self,
        settings: SchedulerSettings,
        metrics: SchedulerMetrics,
        on_ready_change: Callable[[bool], Awaitable[None]] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.policy = RoutingPolicy(settings.routing)
        self.workers: dict[str, WorkerLoop] = {}
        self.submissions: dict[str, Submission] = {}
        # Requests of a lost worker that no other worker could take; they wait for one to attach.
        self.parked = WaitingQueue()
        # Each request's log lines (request_id and trace_id on each) and, with --otlp-endpoint, its spans.
        self.request_log = RequestLog(tracing)
        self.outputs = OutputProcessor(metrics, self.request_log)
        self.stopping = False
        # After the shutdown grace: workers end their streams even with requests left.
        self.closing = False
        self.num_workers_lost = 0
        self.num_requeued = 0
        # The served model's name, from the first worker that attached: the model_name label of every
        # series (read by the metrics thread, so a plain attribute rather than a walk over self.workers).
        self.model_name = ""
        self._on_ready_change = on_ready_change
        self._published_ready: bool | None = None
        self._turn = 0
        # Per request: when its caller's deadline passes, and (while parked) when it stops waiting for a worker.
        self._deadline_timers: dict[str, asyncio.TimerHandle] = {}
        self._wait_timers: dict[str, asyncio.TimerHandle] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.kv_lookup = (
            KVStoreLookup(settings.kv_store, settings.kv_store_lookup_timeout, metrics, security=settings)
            if settings.kv_store
            else None
        )
        # Requests between admission (or losing their worker) and routing, while the kvstore is asked about
        # them; and the tasks asking.
        self._looking_up: dict[str, Request] = {}
        self._lookup_tasks: set[asyncio.Task[None]] = set()

    # ---- registry --------------------------------------------------------

    def ready_workers(self) -> list[WorkerLoop]:
        return [w for w in self.workers.values() if w.state is WorkerState.READY]

    def limits(self) -> ModelLimits | None:
        """Bounds a new request must fit: the tightest over the ready workers (None without one)."""
        ready = self.ready_workers()
        if not ready:
            return None
        return ModelLimits(
            max_model_len=min(w.planner.max_model_len for w in ready),
            vocab_size=min(w.hello.vocab_size for w in ready),
            max_sequence_tokens=min(
                min(w.planner.max_model_len, w.planner.kv.num_blocks * w.planner.block_size) for w in ready
            ),
        )

    def check_hello(self, hello: worker_pb2.WorkerHello) -> None:
        """Raise InvalidField (without the 'hello.' prefix) for a worker that may not attach."""
        if not hello.worker_id:
            raise InvalidField("worker_id", "is empty")
        if hello.worker_id in self.workers:
            raise InvalidField("worker_id", f"{hello.worker_id!r} is already attached; use a unique id")
        for name in ("block_size", "num_blocks", "max_model_len", "vocab_size"):
            if getattr(hello, name) <= 0:
                raise InvalidField(name, "must be > 0")
        if hello.step_slots > MAX_STEP_SLOTS:
            # Each slot is a step the scheduler keeps in flight (and remembers) for this worker.
            raise InvalidField("step_slots", f"{hello.step_slots} exceeds {MAX_STEP_SLOTS} (one per pipeline stage)")
        identities = {w.hello.model_identity for w in self.workers.values()}
        if identities and hello.model_identity not in identities:
            raise InvalidField(
                "model_identity", "differs from the attached workers' model; run one model per scheduler"
            )

    def attach(self, hello: worker_pb2.WorkerHello) -> WorkerLoop:
        """Register a checked worker (ATTACHING until mark_ready)."""
        s = self.settings
        worker = WorkerLoop.create(
            hello,
            max_num_seqs=_step_limit(s.max_num_seqs, hello.max_num_seqs, DEFAULT_MAX_NUM_SEQS),
            max_num_batched_tokens=_step_limit(
                s.max_num_batched_tokens, hello.max_num_batched_tokens, DEFAULT_MAX_NUM_BATCHED_TOKENS
            ),
            max_model_len=min(hello.max_model_len, s.max_model_len or hello.max_model_len),
            enable_prefix_caching=s.enable_prefix_caching,
            depth=2 if s.async_scheduling else 1,
            listener=WorkerMetrics(self.metrics, hello.worker_id),
            kv_store=self._kv_store_use(hello),
            long_prefill_token_threshold=s.long_prefill_token_threshold,
            speculation=s.speculative_config,
            waiting=WaitingQueue(s.scheduling_policy, s.scheduling_aging_tokens_per_second),
        )
        self.workers[hello.worker_id] = worker
        self.model_name = self.model_name or hello.model_name
        log.info(
            "worker attached",
            worker_id=hello.worker_id,
            device=hello.device,
            model=hello.model_name,
            num_blocks=hello.num_blocks,
            block_size=hello.block_size,
            # What this worker's steps are planned within: the smaller of the scheduler's and its own.
            max_num_seqs=worker.planner.max_num_seqs,
            max_num_batched_tokens=worker.planner.max_num_batched_tokens,
            # Steps kept in flight on it (one per pipeline stage when micro-batched).
            steps_in_flight=worker.depth,
            micro_batches=worker.planner.micro_batches,
            # The order its queue admits in (--scheduling-policy).
            scheduling_policy=worker.waiting.policy,
        )
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            own, reported = getattr(s, name), getattr(hello, name)
            if own is not None and reported and reported < own:
                log.warning(
                    f"the worker runs a smaller --{name.replace('_', '-')} than this scheduler; its steps are "
                    "planned within the worker's",
                    worker_id=hello.worker_id,
                    scheduler=own,
                    worker=reported,
                )
        self._update_gauges()
        return worker

    def _kv_store_use(self, hello: worker_pb2.WorkerHello) -> KVStoreUse | None:
        """Loads and saves for this worker need a store on both ends and block hashes (prefix caching)."""
        if self.kv_lookup is None or not hello.kv_store_enabled or not self.settings.enable_prefix_caching:
            return None
        return KVStoreUse(
            kv_format=hello.kv_format,
            swap=self.settings.preemption_mode == "swap",
            save_on_reuse=self.settings.kv_store_write_policy == "write-through-selective",
        )

    def mark_ready(self, worker: WorkerLoop) -> None:
        """The worker was told it is accepted: route to it, starting with requests that waited for a worker."""
        if self.stopping:
            worker.state = WorkerState.DRAINING
            return
        worker.state = WorkerState.READY
        parked = self.parked.take_all()
        for request in parked:
            _cancel(self._wait_timers, request.request_id)
        self._requeue(parked, f"worker {worker.worker_id} attached")
        self._update_gauges()

    def begin_drain(self, worker: WorkerLoop, reason: str) -> None:
        """The worker is leaving: nothing new goes to it; its queued requests move to the others now."""
        if worker.state is not WorkerState.READY:
            return
        log.info("worker draining", worker_id=worker.worker_id, reason=reason)
        worker.state = WorkerState.DRAINING
        self._requeue(worker.take_waiting(), f"worker {worker.worker_id} is draining: {reason}")
        worker.wake.set()
        self._update_gauges()

    def detach(self, worker: WorkerLoop, lost_reason: str | None) -> None:
        """The worker's stream ended; with a lost_reason it did not leave cleanly. Its requests move on."""
        self.workers.pop(worker.worker_id, None)
        if lost_reason is not None:
            worker.state = WorkerState.LOST
            worker.lost_reason = lost_reason
            self.num_workers_lost += 1
            self.metrics.workers_lost.labels(reason=lost_reason.split(" ", 1)[0]).inc()
        orphans = [r for r in worker.release() if self._is_live(r.request_id)]
        self._requeue(
            orphans,
            f"worker {worker.worker_id} lost: {lost_reason}" if lost_reason else f"worker {worker.worker_id} left",
        )
        self.num_requeued += len(orphans)
        self.metrics.requests_requeued.inc(len(orphans))
        logger = log.warning if lost_reason else log.info
        logger("worker detached", worker_id=worker.worker_id, lost=lost_reason, requeued=len(orphans))
        if worker.worker_id not in self.workers:
            self.metrics.forget_worker(worker.worker_id)
        self._update_gauges()

    async def publish_readiness(self) -> None:
        """Tell health whether requests can run now (a ready worker and not shutting down)."""
        ready = bool(self.ready_workers()) and not self.stopping
        if ready != self._published_ready and self._on_ready_change is not None:
            self._published_ready = ready
            await self._on_ready_change(ready)

    # ---- requests --------------------------------------------------------

    def num_waiting(self) -> int:
        return len(self.parked) + len(self._looking_up) + sum(len(w.waiting) for w in self.workers.values())

    def submit(self, submit: scheduler_pb2.SubmitRequest, sink: Sink) -> Submission | Failure:
        """Admit, route and queue a request whose events go to sink; or why not (logged, every refusal)."""
        admitted = self._admit(submit, sink)
        if isinstance(admitted, Failure):
            self.request_log.refused(submit, admitted)
        return admitted

    def _admit(self, submit: scheduler_pb2.SubmitRequest, sink: Sink) -> Submission | Failure:
        retry = self.settings.retry_after
        if self.stopping:
            return Failure(
                grpc.StatusCode.UNAVAILABLE, "scheduler is shutting down; retry on another", retry_after=retry
            )
        limits = self.limits()
        if limits is None:
            return Failure(
                grpc.StatusCode.UNAVAILABLE,
                "no worker is ready to serve; retry later",
                retry_after=retry,
                reason=Reason.NO_READY_WORKER,
            )
        if submit.request_id in self.submissions:
            return Failure(grpc.StatusCode.ALREADY_EXISTS, f"request_id {submit.request_id!r} is already running")
        waiting = self.num_waiting()
        if waiting >= self.settings.max_waiting_requests:
            return Failure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{waiting} requests are waiting (--max-waiting-requests); retry later",
                retry_after=retry,
            )
        admitted = admit(submit, limits)
        if isinstance(admitted, Failure):
            return admitted
        sub = Submission(admitted, sink)
        self.submissions[admitted.request_id] = sub
        self._idle.clear()
        if self._store_formats() and admitted.num_tokens > 1:
            # Logged as submitted once routed, after the lookup.
            self._look_up_then_place([admitted])
        elif self._route(admitted):
            self.request_log.submitted(admitted)
        if admitted.deadline is not None:
            self._deadline_timers[admitted.request_id] = _later(
                admitted.deadline - time.monotonic(), self._deadline_passed, admitted.request_id
            )
        self._update_gauges()
        return sub

    def release(self, request_id: str) -> None:
        """Forget a submission whose caller is done with it; abort it first if it is still running."""
        sub = self.submissions.get(request_id)
        if sub is None:
            return
        if not sub.finished:
            # The caller went away (or a stop string matched at the gateway).
            self.abort(request_id)
        del self.submissions[request_id]
        _cancel(self._deadline_timers, request_id)
        _cancel(self._wait_timers, request_id)
        if not self.submissions:
            self._idle.set()

    def abort(self, request_id: str) -> bool:
        """Take the request out of every queue and worker (its blocks are freed); whether it was found."""
        sub = self.submissions.get(request_id)
        running = sub is not None and not sub.finished
        found = self._take_out(request_id)
        if found or running:
            self.request_log.aborted(sub, request_id)
        return found

    def _take_out(self, request_id: str) -> bool:
        sub = self.submissions.get(request_id)
        if sub is not None:
            sub.finished = True
        found = self.parked.remove(request_id) is not None
        found = self._looking_up.pop(request_id, None) is not None or found
        for worker in self.workers.values():
            found = worker.abort(request_id) or found
        if found:
            self.outputs.finished()
        self._update_gauges()
        return found

    def fail(self, request_id: str, failure: Failure) -> None:
        """End a request with an error status (it is aborted everywhere first)."""
        sub = self.submissions.get(request_id)
        if sub is None or sub.finished:
            return
        self._take_out(request_id)
        self.request_log.failed(sub, failure)
        sub.send(failure)

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        self.outputs.process(outputs, self.submissions)
        self._update_gauges()

    def _is_live(self, request_id: str) -> bool:
        sub = self.submissions.get(request_id)
        return sub is not None and not sub.finished

    def _route(self, request: Request, front: bool = False) -> bool:
        """Put a request on the best ready worker's queue (request.worker_id says whose); False when none can
        hold it."""
        total = request.num_prompt_tokens + request.max_tokens
        candidates = [w for w in self.ready_workers() if w.planner.can_ever_fit(total)]
        if not candidates:
            return False
        seen = {w.worker_id: w.candidate(request) for w in candidates}
        chosen = choose_worker(self.policy, list(seen.values()), request.num_tokens, self._turn)
        self._turn += 1
        worker = self.workers[chosen]
        worker.enqueue(request, front=front, work=request.num_tokens - seen[chosen].cached_tokens)
        request.worker_id = chosen
        self.metrics.routed.labels(worker=chosen).inc()
        return True

    def _store_formats(self) -> list[tuple[str, int]]:
        """(KV format, block size) of each kind of ready worker that loads from the kvstore."""
        formats = {
            (w.planner.kv_store.kv_format, w.planner.block_size)
            for w in self.ready_workers()
            if w.planner.kv_store is not None
        }
        return sorted(formats)

    def _look_up_then_place(self, requests: list[Request], requeued: str | None = None) -> None:
        """Ask the kvstore how much of each request is stored, then route them (in their order); `requeued`:
        why they left their worker (None for new submissions), see _place."""
        assert self.kv_lookup is not None
        lookup = self.kv_lookup
        formats = self._store_formats()
        for request in requests:
            self._looking_up[request.request_id] = request

        async def run() -> None:
            try:
                await asyncio.gather(*(lookup.lookup(r, formats) for r in requests))
            finally:
                # Those aborted meanwhile were taken out of _looking_up.
                live = [r for r in requests if self._looking_up.pop(r.request_id, None) is not None]
                self._place(live, requeued)
                self._update_gauges()

        task = asyncio.get_running_loop().create_task(run())
        self._lookup_tasks.add(task)
        task.add_done_callback(self._lookup_tasks.discard)

    def _requeue(self, requests: list[Request], why: str) -> None:
        """Requests that must run elsewhere (`why`: their worker was lost, left, or a worker came for the parked
        ones) go to the heads of other workers' queues (in their order), or wait up to --worker-wait-timeout
        for a worker when none is ready. With a kvstore they first learn what of them is stored, so they
        resume from saved blocks instead of recomputing."""
        if requests and self._store_formats():
            self._look_up_then_place(requests, requeued=why)
        else:
            self._place(requests, requeued=why)

    def _place(self, requests: list[Request], requeued: str | None) -> None:
        """Route new submissions (requeued None) in order, or requeued ones to the heads of queues; each is
        logged with the worker it went to."""
        front = requeued is not None
        for request in reversed(requests) if front else requests:
            previous = request.worker_id
            if self._route(request, front=front):
                if requeued is None:
                    self.request_log.submitted(request)
                else:
                    self.request_log.requeued(request, previous, requeued)
                continue
            if self.ready_workers() or self.stopping:
                why = "no attached worker can hold this request" if not self.stopping else "scheduler is shutting down"
                self.fail(request.request_id, Failure(grpc.StatusCode.UNAVAILABLE, why))
                continue
            self.parked.prepend(request)
            request.worker_id = ""
            if requeued is None:
                self.request_log.submitted(request)  # with no worker: it waits for one to attach
            else:
                self.request_log.requeued(request, previous, requeued)
            self._wait_timers[request.request_id] = _later(
                self.settings.worker_wait_timeout, self._wait_expired, request.request_id
            )

    def _deadline_passed(self, request_id: str) -> None:
        self.fail(request_id, Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"))

    def _wait_expired(self, request_id: str) -> None:
        if request_id in self.parked:
            self.fail(
                request_id,
                Failure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no worker attached within --worker-wait-timeout ({self.settings.worker_wait_timeout:g}s)",
                    retry_after=self.settings.retry_after,
                ),
            )

    def _update_gauges(self) -> None:
        """Set the queue, batch and KV gauges from the state now (after every event that changes it)."""
        metrics = self.metrics
        metrics.num_requests_waiting.set(self.num_waiting())
        metrics.num_workers.set(len(self.ready_workers()))
        running = used = total = 0
        for worker in self.workers.values():
            planner = worker.planner
            pool = planner.kv.pool
            running += planner.num_running
            used += pool.num_blocks - pool.num_free_blocks
            total += pool.num_blocks
            metrics.worker_num_requests_running.labels(worker=worker.worker_id).set(planner.num_running)
            metrics.worker_num_requests_waiting.labels(worker=worker.worker_id).set(len(worker.waiting))
            metrics.worker_kv_cache_usage_perc.labels(worker=worker.worker_id).set(pool.usage)
        metrics.num_requests_running.set(running)
        metrics.kv_cache_usage_perc.set(used / total if total else 0.0)

    # ---- views -------------------------------------------------------------

    def model_info(self) -> scheduler_pb2.ModelInfo:
        ready = self.ready_workers()
        limits = self.limits()
        first = ready[0].hello if ready else next((w.hello for w in self.workers.values()), None)
        return scheduler_pb2.ModelInfo(
            model_name=first.model_name if first else "",
            model_identity=first.model_identity if first else "",
            max_model_len=limits.max_model_len if limits else 0,
            vocab_size=limits.vocab_size if limits else 0,
            num_ready_workers=len(ready),
            accepting=not self.stopping,
            num_requests=len(self.submissions),
        )

    def stats(self) -> scheduler_pb2.SchedulerStats:
        out = scheduler_pb2.SchedulerStats(
            num_waiting=self.num_waiting(),
            num_finished=self.outputs.num_finished,
            num_workers_lost=self.num_workers_lost,
            num_requeued=self.num_requeued,
            kv_store_enabled=self.kv_lookup is not None,
        )
        if self.kv_lookup is not None:
            out.kv_store_lookups = self.kv_lookup.num_lookups
            out.kv_store_lookup_errors = self.kv_lookup.num_errors
        for worker_id, worker in self.workers.items():
            s = worker.planner.stats()
            out.num_running += s.num_running
            out.num_steps += s.num_steps
            out.num_mixed_steps += s.num_mixed_steps
            out.max_batch_size = max(out.max_batch_size, s.max_batch_size)
            out.num_preemptions += s.num_preemptions
            out.prefix_cache_queries += s.prefix_cache_queries
            out.prefix_cache_hits += s.prefix_cache_hits
            out.kv_store_loaded_tokens += s.kv_store_loaded_tokens
            out.kv_store_load_misses += s.kv_store_load_misses
            out.kv_store_resumed += s.kv_store_resumed
            out.workers.append(
                scheduler_pb2.WorkerPoolStats(
                    worker_id=worker_id,
                    num_blocks=s.num_blocks,
                    num_free_blocks=s.num_free_blocks,
                    num_cached_blocks=s.num_cached_blocks,
                    num_running=s.num_running,
                    state=worker.state.value,
                    num_waiting=len(worker.waiting),
                    num_routed=worker.num_routed,
                    prefix_cache_queries=s.prefix_cache_queries,
                    prefix_cache_hits=s.prefix_cache_hits,
                    num_steps=s.num_steps,
                    kv_store_loaded_tokens=s.kv_store_loaded_tokens,
                    kv_store_load_misses=s.kv_store_load_misses,
                    kv_store_saves=s.kv_store_saves,
                    kv_store_saves_dropped=s.kv_store_saves_dropped,
                )
            )
        return out

    # ---- shutdown ----------------------------------------------------------

    async def shutdown(self, grace: float) -> None:
        """Refuse new work, let running requests finish within the grace, then release the workers."""
        self.stopping = True
        await self.publish_readiness()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, grace - 1.0))
        except TimeoutError:
            log.warning("shutdown grace ran out", requests=len(self.submissions))
        self.closing = True
        for worker in self.workers.values():
            worker.wake.set()
        if self.kv_lookup is not None:
            await self.kv_lookup.close()


def _later(delay: float, callback: Callable[[str], None], request_id: str) -> asyncio.TimerHandle:
    return asyncio.get_running_loop().call_later(max(0.0, delay), callback, request_id)


def _cancel(timers: dict[str, asyncio.TimerHandle], request_id: str) -> None:
    handle = timers.pop(request_id, None)
    if handle is not None:
        handle.cancel()


def _step_limit(own: int | None, reported: int, unreported: int) -> int:
    """What a worker's steps are planned within: the smaller of this scheduler's flag (None: unset) and the
    worker's own limit (0: a worker from before the field); `unreported`, the default such a worker ran
    with, when neither says."""
    limits = [v for v in (own, reported) if v]
    return min(limits) if limits else unreported
