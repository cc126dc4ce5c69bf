"""One attached worker's engine loop state: its queue, its planner, the steps in flight, its health.

vLLM's EngineCore idea without gRPC: plan a step, apply its result, fail it, or hand every request
back when the worker is lost. The async driver in worker_stream.py moves the messages.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from dataclasses import dataclass, field

from services.common.proto.meshserve.v1 import worker_pb2
from services.scheduler.request import Request
from services.scheduler.router import Candidate
from services.scheduler.speculation import SpeculativeConfig
from services.scheduler.waiting_queue import WaitingQueue
from services.scheduler.worker_scheduler import KVStoreUse, PlannerListener, RequestOutput, WorkerScheduler

# Most steps one worker may ask to have in flight (WorkerHello.step_slots: one per pipeline stage).
MAX_STEP_SLOTS = 64


class WorkerState(enum.Enum):
    """Where a worker is in its life; one field instead of flags."""

    # Hello received and checked; not yet told it is accepted.
    ATTACHING = "ATTACHING"
    # Takes new requests.
    READY = "READY"
    # Leaving (its SIGTERM, or the scheduler's own shutdown): runs what it has, takes nothing new.
    DRAINING = "DRAINING"
    # Stream broken, heartbeat missed or a step stuck: its requests went elsewhere.
    LOST = "LOST"


class StepProtocolError(RuntimeError):
    """The worker answered a step it was not sent (a bug or a confused peer): the worker is lost."""


@dataclass
class _InFlight:
    step: worker_pb2.Step
    # When the worker could start it: sent, or the previous step answered, whichever is later.
    started: float


@dataclass
class WorkerLoop:
    """The scheduler's view of one worker."""

    hello: worker_pb2.WorkerHello
    planner: WorkerScheduler
    # Steps planned ahead of the answers: 2 with async scheduling (the next goes out while one runs).
    depth: int
    state: WorkerState = WorkerState.ATTACHING
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    last_message_at: float = field(default_factory=time.monotonic)
    num_routed: int = 0
    # Why it was lost, for logs and the detach decision.
    lost_reason: str = ""
    _in_flight: collections.deque[_InFlight] = field(default_factory=collections.deque)
    # Block hashes of prompts routed here and not yet finished (refcounts), so a burst of one prefix
    # sticks to this worker before the first request has computed it.
    _routed_hashes: collections.Counter[bytes] = field(default_factory=collections.Counter)
    _hashes_of: dict[str, list[bytes]] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        hello: worker_pb2.WorkerHello,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool,
        depth: int,
        listener: PlannerListener | None = None,
        kv_store: KVStoreUse | None = None,
        long_prefill_token_threshold: int = 0,
        speculation: SpeculativeConfig | None = None,
        waiting: WaitingQueue | None = None,
    ) -> WorkerLoop:
        planner = WorkerScheduler(
            worker_id=hello.worker_id,
            num_blocks=hello.num_blocks,
            block_size=hello.block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            waiting=waiting if waiting is not None else WaitingQueue(),
            listener=listener,
            kv_store=kv_store,
            long_prefill_token_threshold=long_prefill_token_threshold,
            speculation=speculation,
            micro_batches=max(1, hello.step_slots),
        )
        # A pipelined worker runs one step per stage at once: keep every stage busy.
        return cls(hello=hello, planner=planner, depth=max(depth, hello.step_slots))

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    @property
    def waiting(self) -> WaitingQueue:
        return self.planner.waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def is_idle(self) -> bool:
        """Nothing admitted, queued or in flight."""
        return not self._in_flight and self.planner.num_admitted == 0 and len(self.waiting) == 0

    # ---- routing -------------------------------------------------------

    def enqueue(self, request: Request, front: bool = False, work: int | None = None) -> None:
        """A routed request joins this worker's queue (at the head for requeued work, so it finishes first).

        work: the tokens it will compute here (its prompt less the cached prefix), the router's estimate."""
        if front:
            self.waiting.prepend(request, work)
        else:
            self.waiting.append(request, work)
        if request.request_id not in self._hashes_of:
            hashes = list(request.get_block_hashes(self.planner.block_size))
            self._hashes_of[request.request_id] = hashes
            self._routed_hashes.update(hashes)
            self.num_routed += 1
        self.wake.set()

    def forget(self, request_id: str) -> None:
        """The request left this worker for good (finished, aborted, moved)."""
        hashes = self._hashes_of.pop(request_id, None)
        if hashes:
            self._routed_hashes.subtract(hashes)
            for h in hashes:
                if self._routed_hashes[h] <= 0:
                    del self._routed_hashes[h]

    def candidate(self, request: Request) -> Candidate:
        """How this worker looks to the router for this request."""
        bs = self.planner.block_size
        kv = self.planner.kv
        hashes = request.get_block_hashes(bs)
        max_hit = request.max_reusable_blocks(bs)
        hit = 0
        if kv.enable_prefix_caching:
            for h in hashes[:max_hit]:
                if h not in self._routed_hashes and kv.pool.get_cached_block(h) is None:
                    break
                hit += 1
        stored = 0
        if self.planner.kv_store is not None:
            stored = min(request.stored_blocks.get(self.planner.kv_store.kv_format, 0), max_hit)
        total_blocks = -(-request.num_tokens // bs)
        # A running request still in its prefill is queued work too: it is admitted long before it is done.
        prefilling = sum(
            r.num_tokens - r.num_computed_tokens
            for r in self.planner.running
            if r.num_computed_tokens < r.num_prompt_tokens
        )
        return Candidate(
            worker_id=self.worker_id,
            cached_tokens=hit * bs,
            stored_tokens=max(0, stored - hit) * bs,
            queued_tokens=self.waiting.num_tokens + prefilling,
            num_waiting=len(self.waiting),
            num_running=self.planner.num_admitted,
            free_blocks=kv.pool.num_free_blocks,
            needed_blocks=total_blocks - hit,
            block_size=bs,
        )

    # ---- steps -----------------------------------------------------------

    def plan(self, now: float) -> worker_pb2.Step | None:
        """The next step to send, if the pipeline has room and there is work."""
        if self.state not in (WorkerState.READY, WorkerState.DRAINING) or len(self._in_flight) >= self.depth:
            return None
        step = self.planner.schedule(admit=self.state is WorkerState.READY)
        if step is None and not self._in_flight:
            # Only loads are pending: an empty step collects their answers.
            step = self.planner.poll_step()
        if step is not None:
            self._in_flight.append(_InFlight(step, now))
        return step

    def apply(self, result: worker_pb2.StepResult, now: float) -> list[RequestOutput]:
        """The worker answered the oldest step in flight; a failed step fails the ones planned on it too."""
        if not self._in_flight:
            raise StepProtocolError(f"result for step {result.step_id} with no step in flight")
        head = self._in_flight.popleft()
        if result.step_id != head.step.step_id:
            raise StepProtocolError(f"result for step {result.step_id}, expected {head.step.step_id}")
        if self._in_flight:
            # The next step starts on the worker now; its stuck-timer runs from here.
            self._in_flight[0].started = max(self._in_flight[0].started, now)
        outputs = self.planner.update(head.step, result)
        if result.error:
            later = list(self._in_flight)
            self._in_flight.clear()
            for item in later:
                outputs += self.planner.fail_step(item.step, f"an earlier step failed: {result.error}")
        for out in outputs:
            if out.finish_reason is not None:
                self.forget(out.request.request_id)
        return outputs

    def abort(self, request_id: str) -> bool:
        """Abort a request queued or running here; whether it was here."""
        found = self.waiting.remove(request_id) is not None or self.planner.abort(request_id) is not None
        if found:
            self.forget(request_id)
            self.wake.set()
        return found

    def take_waiting(self) -> list[Request]:
        """Hand back the requests queued here but not admitted (a draining worker's, to route elsewhere)."""
        out = self.waiting.take_all()
        for request in out:
            self.forget(request.request_id)
        return out

    def release(self) -> list[Request]:
        """The worker is lost: every request it held, running first then queued, to recompute elsewhere."""
        running = self.planner.release_all()
        self._in_flight.clear()
        out = running + self.waiting.take_all()
        for request in out:
            self.forget(request.request_id)
        return out

    # ---- health ----------------------------------------------------------

    def heard_from(self, now: float) -> None:
        self.last_message_at = now

    def stuck_reason(self, now: float, heartbeat_timeout: float, step_timeout: float) -> str | None:
        """Why this worker must be treated as lost now, if it must."""
        silent = now - self.last_message_at
        if silent > heartbeat_timeout:
            return f"no message for {silent:.1f}s (heartbeat timeout {heartbeat_timeout:g}s)"
        if self._in_flight:
            running = now - self._in_flight[0].started
            if running > step_timeout:
                step_id = self._in_flight[0].step.step_id
                return f"step {step_id} unanswered for {running:.1f}s (step timeout {step_timeout:g}s)"
        return None

    def next_check_in(self, now: float, heartbeat_timeout: float, step_timeout: float) -> float:
        """Seconds until stuck_reason could first say yes."""
        due = self.last_message_at + heartbeat_timeout
        if self._in_flight:
            due = min(due, self._in_flight[0].started + step_timeout)
        return max(0.01, due - now + 0.01)
