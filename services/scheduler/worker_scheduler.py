"""Step planner for one attached worker: vLLM v1's continuous batching over the wire."""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from services.common.grpc_server import MAX_MESSAGE_BYTES
from services.common.kv_store_limits import MAX_BLOCK_HASHES
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2, worker_pb2
from services.scheduler.block_pool import Block
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus, check_stop
from services.scheduler.speculation import SpeculativeConfig
from services.scheduler.waiting_queue import WaitingQueue

log = structlog.get_logger()

# A Step's new requests carry their whole prompt; past this many bytes (an upper estimate) the rest wait for
# the next step, so a Step always fits the internal message limit however many long prompts arrive at once.
STEP_NEW_REQUEST_BYTES = MAX_MESSAGE_BYTES // 2
# Upper bound of one token id on the wire (a varint of an int32 id) and of a NewRequest's other fields.
_TOKEN_BYTES = 5
_NEW_REQUEST_OVERHEAD = 1024
# Upper bound of one KVBlockRef (of a KVLoad, or a save) on the wire (a 32-byte hash, a block id, tags and lengths).
_BLOCK_REF_BYTES = 48


def new_request_bytes(request: Request) -> int:
    """An upper estimate of the request's NewRequest on the wire."""
    return _NEW_REQUEST_OVERHEAD + request.sampling.ByteSize() + _TOKEN_BYTES * request.num_tokens


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[float]
    finish_reason: RequestStatus | None
    new_top_logprobs: list[sampling_pb2.TopLogprobs] = field(default_factory=list)
    # The worker's error text when the step (or this request alone) failed (finish_reason is then
    # FINISHED_ABORTED).
    error: str | None = None
    # For a request that failed alone because of one of its fields: that field (INVALID_ARGUMENT).
    error_field: str = ""


@dataclass
class WorkerSchedulerStats:
    """Counters and pool state of one worker's scheduler."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_steps: int
    num_mixed_steps: int
    max_batch_size: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_usage: float = 0.0
    kv_store_loaded_tokens: int = 0
    kv_store_load_misses: int = 0
    kv_store_saves: int = 0
    kv_store_saves_dropped: int = 0
    kv_store_resumed: int = 0


@dataclass
class _Planned:
    request: Request
    num_computed: int
    # Drafts included.
    num_scheduled: int
    new_block_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Load:
    """A request whose blocks [first_block, first_block + num_blocks) the worker is loading from the kvstore."""

    request: Request
    first_block: int
    num_blocks: int
    # Its first admission (not a resume): the loaded tokens count as its cached_tokens.
    first_admission: bool


@dataclass(frozen=True)
class KVStoreUse:
    """How this worker's planner uses the kvstore (None in WorkerScheduler: not at all)."""

    # The worker's KV format key: which stored blocks it can load.
    kv_format: str
    # --preemption-mode swap: a preempted request resumes from the blocks it saved, not by recomputing.
    swap: bool = False
    # --kv-store-write-policy write-through-selective: a block is saved the first time a request reuses it,
    # not when it is computed.
    save_on_reuse: bool = False


class PlannerListener(Protocol):
    """Told of planning events as they happen, so counters move with the events (no diffing of totals)."""

    def preempted(self, request: Request) -> None: ...

    def prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None: ...

    def kv_loaded(self, num_tokens: int, num_missed_blocks: int) -> None: ...

    def drafted(self, num_draft_tokens: int) -> None: ...

    def drafts_verified(self, num_accepted_tokens: int) -> None: ...


class WorkerScheduler:
    """Plans steps for one worker: running requests first, then admissions from the worker's own queue.

    Async scheduling's bookkeeping has two homes only: _commit books what a planned step will compute
    (and the token it will sample, `num_pending_samples`); _reset_progress forgets it when a request
    leaves the worker (preemption, or the worker being lost). update() consumes the pending sample.
    """

    def __init__(
        self,
        worker_id: str,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool,
        waiting: WaitingQueue,
        listener: PlannerListener | None = None,
        kv_store: KVStoreUse | None = None,
        long_prefill_token_threshold: int = 0,
        speculation: SpeculativeConfig | None = None,
        micro_batches: int = 1,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.worker_id = worker_id
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.waiting = waiting
        self.listener = listener
        self.kv_store = kv_store
        self.speculation = speculation
        # Above 1: steps in flight are this many micro-batches of disjoint requests (a pipeline-parallel worker
        # runs one per stage at once, and a request's next step needs the token its last one samples on the
        # last stage), each taking its share of the running requests so every stage gets as much work.
        self.micro_batches = micro_batches
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, max_model_len)
        # Admission order: the last one is the newest and the first to be preempted.
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        # Ids the worker holds in its persistent batch.
        self._on_worker: set[str] = set()
        self._pending_removals: list[str] = []
        # Blocks indexed while planning each step in flight, by step id; un-indexed if that step fails.
        self._inflight_cached: dict[int, list[Block]] = {}
        self._next_step_id = 1
        # Loads sent to the worker and not yet answered, by load id; and requests whose load answered,
        # holding their blocks, admitted before anything from the queue.
        self.loading: dict[int, _Load] = {}
        self._loaded: collections.deque[Request] = collections.deque()
        self._pending_loads: list[worker_pb2.KVLoad] = []
        self._next_load_id = 1
        self.kv_store_loaded_tokens = 0
        self.kv_store_load_misses = 0
        self.kv_store_saves = 0
        self.kv_store_saves_dropped = 0
        self.kv_store_resumed = 0
        # A request was swapped out while this step was planned: the step tells the worker to send its queued
        # saves now (Step.kv_saves_flush), since the request resumes from them.
        self._flush_saves = False
        # Under save_on_reuse: cached blocks that requests admitted into the step being planned reuse, and
        # that are not in the store yet; that step saves them.
        self._reused_unsaved: list[Block] = []
        self.num_steps = 0
        self.num_mixed_steps = 0
        self.max_batch_size = 0
        self.num_preemptions = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def micro_batched(self) -> bool:
        """Whether steps in flight hold disjoint requests."""
        return self.micro_batches > 1

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_admitted(self) -> int:
        """Requests holding blocks here: running, loading a stored prefix, or loaded and about to run."""
        return len(self.running) + len(self.loading) + len(self._loaded)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens (prompt + max_tokens) could ever run on this worker."""
        return self.kv.can_ever_fit(num_tokens)

    def schedule(self, admit: bool = True) -> worker_pb2.Step | None:
        """Plan the next step; None when nothing runs and nothing needs removing.

        admit=False (a draining worker) runs what is running and admits nothing from the queue.

        May be called again before the previous step's update(): progress is booked when a step is
        planned, and a token a step in flight will sample counts as pending, so the next step can compute
        it (async scheduling: the worker appends the tokens it samples itself).
        """
        speculating = self._speculating()
        if speculating and any(r.num_pending_samples for r in self.running):
            # A draft continues a request's last token: steps are planned once the one in flight has answered
            # (async scheduling gives way to speculation while the batch is small enough to speculate).
            return None
        budget = self.max_num_batched_tokens
        planned_running: list[_Planned] = []
        preempted = False

        share = -(-len(self.running) // self.micro_batches)
        i = 0
        while i < len(self.running) and budget > 0 and len(planned_running) < share:
            request = self.running[i]
            num_new = self._chunk(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            if (
                num_new <= 0
                or request.num_draft_tokens_in_flight
                or request.num_output_tokens + request.num_pending_samples >= request.max_tokens
                or (self.micro_batched and request.in_flight_step)
            ):
                # Nothing to compute yet, its tokens wait on a verification in flight, the token in flight
                # is its last one, or another micro-batch in flight holds it.
                i += 1
                continue
            drafts = self._propose(request, budget) if speculating else []
            new_ids = self.kv.allocate_slots(request, num_new + len(drafts))
            if new_ids is None and drafts:
                # Drafts only ever use spare blocks: never preempt anyone for them.
                drafts = []
                new_ids = self.kv.allocate_slots(request, num_new)
            num_new += len(drafts)
            while new_ids is None:
                # The newest running request gives its blocks back; it may be this one.
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_ids = self.kv.allocate_slots(request, num_new)
            if new_ids is None:
                break
            planned_running.append(_Planned(request, request.num_computed_tokens, num_new, new_ids, drafts))
            budget -= num_new
            i += 1

        planned_new: list[_Planned] = []
        new_bytes = 0
        if not preempted and admit:
            # Requests whose stored prefix arrived go first: they hold blocks already.
            while budget > 0 and len(self.running) < self.max_num_seqs and self._loaded:
                request = self._loaded[0]
                size = new_request_bytes(request)
                if planned_new and new_bytes + size > STEP_NEW_REQUEST_BYTES:
                    break
                num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
                new_ids = self.kv.allocate_slots(request, num_new)
                if new_ids is None:
                    break
                new_bytes += size
                self._loaded.popleft()
                planned_new.append(self._start(request, request.num_computed_tokens, num_new))
                budget -= num_new
            while budget > 0 and self.num_admitted < self.max_num_seqs and len(self.waiting) > 0:
                head = self.waiting.peek()
                assert head is not None
                request = head
                if request.is_finished:
                    self.waiting.popleft()  # aborted while queued but not taken out: skip it
                    continue
                size = new_request_bytes(request)
                if planned_new and new_bytes + size > STEP_NEW_REQUEST_BYTES:
                    break
                hits, num_hit = self.kv.get_computed_blocks(request)
                num_load = self._num_blocks_to_load(request, len(hits))
                if num_load:
                    # The stored blocks beyond the local prefix load into reserved blocks, off the step
                    # path; the request runs once the worker says which arrived.
                    load_bytes = _NEW_REQUEST_OVERHEAD + _BLOCK_REF_BYTES * (num_load + self._num_new_saves(hits))
                    if new_bytes + load_bytes > STEP_NEW_REQUEST_BYTES:
                        break
                    num_new = num_load * self.block_size
                    if self.kv.allocate_slots(request, num_new, hits, index=False) is None:
                        break
                    new_bytes += load_bytes
                    self.waiting.popleft()
                    self._count_lookup(request, num_hit)
                    self._note_reuse(hits)
                    self._begin_load(request, len(hits), num_load)
                    continue
                # Under save_on_reuse the step also lists the hits not yet stored: they count against its size.
                size += _BLOCK_REF_BYTES * self._num_new_saves(hits)
                if planned_new and new_bytes + size > STEP_NEW_REQUEST_BYTES:
                    break
                num_new = self._chunk(request.num_tokens - num_hit, budget)
                new_ids = self.kv.allocate_slots(request, num_new, hits)
                if new_ids is None:
                    break
                new_bytes += size
                self.waiting.popleft()
                self._count_lookup(request, num_hit)
                self._note_reuse(hits)
                planned_new.append(self._start(request, num_hit, num_new))
                budget -= num_new

        newly_cached = self.kv.take_newly_cached()
        if not planned_running and not planned_new and not self._pending_removals and not self._pending_loads:
            return None
        step = self._build_step(planned_running, planned_new)
        self._inflight_cached[step.step_id] = newly_cached
        if self.kv_store is not None:
            # Write-through: the blocks this step completes go to the store once computed (a preempted or
            # requeued request, or another worker, finds them there later). Selective: the cached blocks this
            # step's admissions reuse for the first time (their KV was written by an earlier step, which the
            # worker computed first).
            if self.kv_store.save_on_reuse:
                saves, self._reused_unsaved = self._reused_unsaved, []
            else:
                saves = newly_cached
            for block in saves:
                if block.block_hash is not None:
                    block.saved = True
                    step.kv_saves.append(worker_pb2.KVBlockRef(block_id=block.block_id, block_hash=block.block_hash))
            self.kv_store_saves += len(step.kv_saves)
            step.kv_saves_flush, self._flush_saves = self._flush_saves, False
            step.kv_loads.extend(self._pending_loads)
            self._pending_loads = []
        self._pending_removals = []
        self._commit(planned_running + planned_new, step.step_id)
        return step

    def _num_new_saves(self, hits: list[Block]) -> int:
        """How many saves admitting a request with these hits adds to the step (under save_on_reuse)."""
        if self.kv_store is None or not self.kv_store.save_on_reuse:
            return 0
        return sum(1 for block in hits if not block.saved)

    def _note_reuse(self, hits: list[Block]) -> None:
        """Under save_on_reuse, queue the hit blocks not yet in the store for the step being planned."""
        if self.kv_store is None or not self.kv_store.save_on_reuse:
            return
        for block in hits:
            if not block.saved:
                block.saved = True  # queued for this step: another admission in it does not queue it again
                self._reused_unsaved.append(block)

    def _speculating(self) -> bool:
        """Whether this step may carry drafts: speculation is on, the batch is small enough, and some running
        request can be speculated."""
        spec = self.speculation
        return spec is not None and spec.active(len(self.running)) and any(r.speculable for r in self.running)

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Drafts for a decoding request, within the step's budget and the tokens it may still generate."""
        assert self.speculation is not None
        if (
            not request.speculable
            or request.num_pending_samples
            or request.num_computed_tokens != request.num_tokens - 1
        ):
            return []
        # The verified step gains the drafts kept and one token more.
        room = min(budget, request.max_tokens - request.num_output_tokens) - 1
        if room < 1:
            return []
        return self.speculation.propose(request.all_token_ids, room)

    def poll_step(self) -> worker_pb2.Step | None:
        """An empty step that only collects finished loads, when loads are pending and nothing else runs."""
        if not self.loading:
            return None
        step = worker_pb2.Step(step_id=self._next_step_id)
        self._next_step_id += 1
        return step

    def _num_blocks_to_load(self, request: Request, num_hit_blocks: int) -> int:
        """Stored blocks of the request beyond its local prefix hit worth loading (0 without a store)."""
        if self.kv_store is None or not self.kv.enable_prefix_caching:
            return 0
        stored = request.stored_blocks.get(self.kv_store.kv_format, 0)
        usable = min(stored, request.max_reusable_blocks(self.block_size), MAX_BLOCK_HASHES)
        return max(0, usable - num_hit_blocks)

    def _count_lookup(self, request: Request, num_hit: int) -> None:
        self.kv.record_prefix_lookup(request.num_tokens, num_hit)
        if self.listener is not None and self.kv.enable_prefix_caching:
            self.listener.prefix_lookup(request.num_tokens, num_hit)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_hit

    def _start(self, request: Request, num_computed: int, num_new: int) -> _Planned:
        """An admitted request joins the running batch; it goes to the worker as a NewRequest."""
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.first_scheduled_at is None:
            request.first_scheduled_at = time.monotonic()
        self.running.append(request)
        self._by_id[request.request_id] = request
        return _Planned(request, num_computed, num_new)

    def _begin_load(self, request: Request, first_block: int, num_blocks: int) -> None:
        first_admission = request.status is RequestStatus.WAITING
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = first_block * self.block_size
        self._by_id[request.request_id] = request
        load_id = self._next_load_id
        self._next_load_id += 1
        self.loading[load_id] = _Load(request, first_block, num_blocks, first_admission)
        table = self.kv.block_ids(request)
        hashes = request.get_block_hashes(self.block_size)
        self._pending_loads.append(
            worker_pb2.KVLoad(
                load_id=load_id,
                blocks=[
                    worker_pb2.KVBlockRef(block_id=table[i], block_hash=hashes[i])
                    for i in range(first_block, first_block + num_blocks)
                ],
            )
        )

    def _finish_load(self, done: worker_pb2.KVLoadDone) -> None:
        """The worker answered a load: the blocks that arrived count as computed, the rest is recomputed."""
        load = self.loading.pop(done.load_id, None)
        if load is None:
            return
        request = load.request
        num_loaded = min(done.num_loaded, load.num_blocks)
        num_missed = load.num_blocks - num_loaded
        self.kv_store_loaded_tokens += num_loaded * self.block_size
        self.kv_store_load_misses += num_missed
        if self.listener is not None:
            self.listener.kv_loaded(num_loaded * self.block_size, num_missed)
        if num_missed:
            # The worker's own lines about this load name only its load_id (and tp_rank): this one ties them
            # to the request. Not an error: the missed blocks are recomputed.
            log.info(
                "kv load short",
                request_id=request.request_id,
                trace_id=request.trace_id,
                worker=self.worker_id,
                load_id=done.load_id,
                loaded_blocks=num_loaded,
                missed_blocks=num_missed,
            )
        if request.is_finished:
            # Aborted while its blocks were being written: only now may they be reused.
            self.kv.free(request)
            return
        end = load.first_block + num_loaded
        self.kv.cache_loaded(request, end)
        request.num_computed_tokens = end * self.block_size
        if load.first_admission:
            # The client's cached_tokens count what it did not wait for, local or stored.
            request.num_cached_tokens = request.num_computed_tokens
        if num_loaded and request.num_output_tokens:
            self.kv_store_resumed += 1
        self._loaded.append(request)

    def _commit(self, planned: list[_Planned], step_id: int) -> None:
        """Book a planned step's progress now, before it answers, so the next step can be planned on top."""
        for p in planned:
            request = p.request
            request.in_flight_step = step_id
            if p.draft_token_ids:
                # Only the known tokens count as computed: update() adds the drafts the worker keeps.
                request.num_computed_tokens = p.num_computed + p.num_scheduled - len(p.draft_token_ids)
                request.num_pending_samples += 1
                request.num_draft_tokens_in_flight = len(p.draft_token_ids)
                self.num_drafts += 1
                self.num_draft_tokens += len(p.draft_token_ids)
                if self.listener is not None:
                    self.listener.drafted(len(p.draft_token_ids))
                continue
            request.num_computed_tokens = p.num_computed + p.num_scheduled
            if request.num_computed_tokens == request.num_tokens_with_pending:
                # The worker samples when a step reaches the end of the tokens it knows.
                request.num_pending_samples += 1

    @staticmethod
    def _reset_progress(request: Request) -> None:
        """The request leaves this worker's cache: it recomputes from scratch, and a token a step in flight
        samples for it is dropped (recomputing samples that position again)."""
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_samples = 0
        request.num_draft_tokens_in_flight = 0
        request.in_flight_step = 0

    def _chunk(self, num_left: int, budget: int) -> int:
        """Tokens of a request to compute in this step: what is left, within the step's budget and, as in
        vLLM, at most --long-prefill-token-threshold when set."""
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < num_left:
            num_left = threshold
        return min(num_left, budget)

    def _build_step(self, planned_running: list[_Planned], planned_new: list[_Planned]) -> worker_pb2.Step:
        step = worker_pb2.Step(step_id=self._next_step_id, removed_request_ids=self._pending_removals)
        self._next_step_id += 1
        for p in planned_running:
            step.scheduled.append(
                worker_pb2.ScheduledRequest(
                    request_id=p.request.request_id,
                    new_block_ids=p.new_block_ids,
                    num_computed_tokens=p.num_computed,
                    num_scheduled_tokens=p.num_scheduled,
                    draft_token_ids=p.draft_token_ids,
                )
            )
        for p in planned_new:
            r = p.request
            step.new_requests.append(
                worker_pb2.NewRequest(
                    request_id=r.request_id,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=r.output_token_ids,
                    sampling=r.sampling,
                    block_ids=self.kv.block_ids(r),
                    num_computed_tokens=p.num_computed,
                    num_scheduled_tokens=p.num_scheduled,
                    eos_token_ids=() if r.sampling.ignore_eos else sorted(r.eos_token_ids),
                    traceparent=r.trace.traceparent,
                )
            )
            self._on_worker.add(r.request_id)
        self._record_step(planned_running + planned_new)
        return step

    def _record_step(self, planned: list[_Planned]) -> None:
        prefill = decode = 0
        for p in planned:
            r = p.request
            # A decode computes exactly the last sampled token; anything else is (re)prefill.
            if p.num_computed >= r.num_prompt_tokens and p.num_computed == r.num_tokens_with_pending - 1:
                decode += p.num_scheduled
            else:
                prefill += p.num_scheduled
        if planned:
            self.num_steps += 1
            self.num_mixed_steps += int(prefill > 0 and decode > 0)
            self.max_batch_size = max(self.max_batch_size, len(planned))

    def update(self, step: worker_pb2.Step, result: worker_pb2.StepResult) -> list[RequestOutput]:
        """Apply a worker's StepResult: advance progress, append tokens, finish requests."""
        if result.step_id != step.step_id:
            raise ValueError(f"StepResult for step {result.step_id} does not answer step {step.step_id}")
        # Loads are answered whatever became of the step (they run beside it).
        for done in result.kv_loads_done:
            self._finish_load(done)
        self.kv_store_saves_dropped += result.kv_saves_dropped
        self._step_answered(step)
        if result.error:
            return self.fail_step(step, result.error)
        self._inflight_cached.pop(step.step_id, None)

        outputs: dict[str, RequestOutput] = {}
        # Speculated requests of this step: how many more tokens each may still gain from it.
        verified: dict[str, int] = {}
        accepted = 0
        for sampled in result.sampled:
            request = self._by_id.get(sampled.request_id)
            # Tokens of requests finished, aborted or preempted while the step was in flight are dropped.
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            rid = request.request_id
            if rid in verified:
                if verified[rid] == 0:
                    continue
                verified[rid] -= 1
                accepted += 1
            elif request.num_pending_samples == 0:
                continue
            else:
                request.num_pending_samples -= 1
                if request.num_draft_tokens_in_flight:
                    verified[rid] = request.num_draft_tokens_in_flight
                    request.num_draft_tokens_in_flight = 0
            if sampled.HasField("failure"):
                # This request alone failed on the worker (e.g. its grammar): end it, the others go on.
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs[request.request_id] = RequestOutput(
                    request,
                    [],
                    [],
                    RequestStatus.FINISHED_ABORTED,
                    error=sampled.failure.message,
                    error_field=sampled.failure.field,
                )
                continue
            request.output_token_ids.append(sampled.token_id)
            out = outputs.get(request.request_id)
            if out is None:
                out = outputs[request.request_id] = RequestOutput(request, [], [], None)
            out.new_token_ids.append(sampled.token_id)
            if request.sampling.logprobs:
                out.new_logprobs.append(sampled.logprob)
                if request.sampling.top_logprobs:
                    out.new_top_logprobs.append(sampled.top_logprobs)
            status = check_stop(request)
            if status is not None:
                self._finish(request, status)
                out.finish_reason = status
                verified.pop(rid, None)
            elif rid in verified:
                # The KV of the drafts kept so far is valid; the newest token is computed by the next step.
                request.num_computed_tokens = request.num_tokens - 1
        if accepted and self.listener is not None:
            self.listener.drafts_verified(accepted)
        self.num_accepted_tokens += accepted
        return list(outputs.values())

    def _step_answered(self, step: worker_pb2.Step) -> None:
        """The step's requests are in no step in flight any more (unless a later one planned them again)."""
        for request_id in itertools.chain((n.request_id for n in step.new_requests),
                                          (s.request_id for s in step.scheduled)):  # fmt: skip
            request = self._by_id.get(request_id)
            if request is not None and request.in_flight_step == step.step_id:
                request.in_flight_step = 0

    def fail_step(self, step: worker_pb2.Step, error: str) -> list[RequestOutput]:
        """Abort the step's requests and forget the prefixes it indexed (their KV may never have been written).

        Also for a step planned after one that failed: it may read blocks the failed one should have filled.
        """
        self.kv.pool.uncache(self._inflight_cached.pop(step.step_id, []))
        outputs: list[RequestOutput] = []
        request_ids = [n.request_id for n in step.new_requests] + [s.request_id for s in step.scheduled]
        for request_id in request_ids:
            request = self._by_id.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(RequestOutput(request, [], [], RequestStatus.FINISHED_ABORTED, error=error))
        return outputs

    def abort(self, request_id: str) -> Request | None:
        """Abort a request admitted on this worker; None when it is not here."""
        request = self._by_id.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self._by_id[request_id]
            if request in self._loaded:
                self._loaded.remove(request)
                self.kv.free(request)
            # Still loading: its blocks are freed when the worker answers the load (_finish_load).
            request.status = RequestStatus.FINISHED_ABORTED
            request.stop_kind = scheduler_pb2.STOP_KIND_ABORT
            return request
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def release_all(self) -> list[Request]:
        """The worker is lost: hand back every admitted request (to run elsewhere) and reset."""
        released = self.running + list(self._loaded) + [load.request for load in self.loading.values()]
        released = [r for r in released if not r.is_finished]
        for request in released:
            self._reset_progress(request)
        self.running = []
        self.loading = {}
        self._loaded.clear()
        self._pending_loads = []
        self._by_id.clear()
        self._on_worker.clear()
        self._pending_removals = []
        self._inflight_cached = {}
        self._reused_unsaved = []
        self.kv.reset()
        return released

    def stats(self) -> WorkerSchedulerStats:
        pool = self.kv.pool
        return WorkerSchedulerStats(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_free_blocks,
            num_running=len(self.running),
            num_steps=self.num_steps,
            num_mixed_steps=self.num_mixed_steps,
            max_batch_size=self.max_batch_size,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            kv_cache_usage=pool.usage,
            kv_store_loaded_tokens=self.kv_store_loaded_tokens,
            kv_store_load_misses=self.kv_store_load_misses,
            kv_store_saves=self.kv_store_saves,
            kv_store_saves_dropped=self.kv_store_saves_dropped,
            kv_store_resumed=self.kv_store_resumed,
        )

    def _preempt(self, request: Request) -> None:
        if self.kv_store is not None:
            kv_format = self.kv_store.kv_format
            if self.kv_store.swap:
                # Write-through: every full block it computed was saved by the step that computed it (steps
                # still in flight save theirs before any later step reuses the blocks), so swapping out
                # costs nothing more here; resuming loads them back.
                saved = min(request.num_computed_tokens, request.num_tokens) // self.block_size
                request.stored_blocks[kv_format] = max(request.stored_blocks.get(kv_format, 0), saved)
                self._flush_saves = True
            else:
                request.stored_blocks.pop(kv_format, None)
        self._remove_running(request)
        self._reset_progress(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the head of this worker's own queue, where its prefix may still be cached.
        self.waiting.prepend(request)
        if self.listener is not None:
            self.listener.preempted(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._remove_running(request)
        request.status = status
        if status is RequestStatus.FINISHED_ABORTED:
            request.stop_kind = scheduler_pb2.STOP_KIND_ABORT

    def _remove_running(self, request: Request) -> None:
        self.kv.free(request)
        self.running.remove(request)
        del self._by_id[request.request_id]
        if request.request_id in self._on_worker:
            self._on_worker.discard(request.request_id)
            self._pending_removals.append(request.request_id)
