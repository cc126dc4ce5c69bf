"""Request state kept by the scheduler for one generation request."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from services.common.speculation import can_speculate
from services.common.tracing import TraceContext, new_trace
from services.scheduler.block_hash import hash_block_tokens


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = enum.auto()
    # Admitted on a worker, its blocks reserved, while the worker loads a stored prefix into them.
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    def is_finished(self) -> bool:
        """True for the three terminal states."""
        return self in _FINISHED

    def finish_reason(self) -> sampling_pb2.FinishReason.ValueType:
        """The wire finish reason (UNSPECIFIED while not finished)."""
        return _FINISH_REASONS.get(self, sampling_pb2.FINISH_REASON_UNSPECIFIED)


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: sampling_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: sampling_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: sampling_pb2.FINISH_REASON_ABORT,
}


class Request:
    """A tokenized request: prompt, generated tokens and progress through the KV cache."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: sampling_pb2.SamplingParams,
        eos_token_ids: Sequence[int],
        max_tokens: int,
        arrival_time: float | None = None,
        deadline: float | None = None,
        trace: TraceContext | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        if max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling = sampling
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.stop_token_ids: frozenset[int] = frozenset(sampling.stop_token_ids)
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # When a worker first took it into a running batch (the end of its queue time); kept across
        # preemptions and moves to another worker, as vLLM's queue time is.
        self.first_scheduled_at: float | None = None
        # time.monotonic() by which the caller gives up (its gRPC deadline); None: no deadline.
        self.deadline = deadline
        # The caller's span (SubmitRequest.traceparent): the parent of this request's phase spans, its trace id
        # on every log line, sent on to the worker. A caller that sent none gets a trace of its own.
        self.trace = trace if trace is not None else new_trace()
        # The worker whose queue or batch holds it now ("" before routing), for its log lines and spans.
        self.worker_id = ""
        self.output_token_ids: list[int] = []
        # Tokens whose KV is in (or, for steps in flight, being written to) this request's blocks.
        self.num_computed_tokens = 0
        # Tokens that steps in flight will sample for this request (0 or 1): known to the worker, not yet here.
        self.num_pending_samples = 0
        # Draft tokens the step in flight verifies for it (speculative decoding): that step gains up to this
        # many tokens more than its pending sample, and num_computed_tokens counts none of them until it answers.
        self.num_draft_tokens_in_flight = 0
        # The step in flight that computes for it, 0 for none: a pipeline-parallel worker's micro-batches hold
        # disjoint requests, so such a request waits for that step's answer before it is planned again.
        self.in_flight_step = 0
        # Whether its sampling lets drafts be verified exactly (decided once: sampling never changes).
        self.speculable = can_speculate(sampling)
        # Prefix-cache hits when the request was first admitted.
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.stop_token_id: int | None = None
        # Which rule finished the request (set with a finished status).
        self.stop_kind: scheduler_pb2.StopKind.ValueType = scheduler_pb2.STOP_KIND_UNSPECIFIED
        # Leading full blocks the kvstore holds, per KV format, as last looked up (or, after a swap-mode
        # preemption, as saved); an estimate: a load that finds fewer recomputes the rest.
        self.stored_blocks: dict[str, int] = {}
        # Hash chains of full blocks, per block size: workers of one scheduler may use different sizes.
        self._block_hashes: dict[int, list[bytes]] = {}

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def trace_id(self) -> str:
        return self.trace.trace_id

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens once the steps in flight have answered: what the next step may compute up to."""
        return self.num_tokens + self.num_pending_samples

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def max_reusable_blocks(self, block_size: int) -> int:
        """Leading full blocks whose KV may come from a cache or the kvstore: the last token is always
        computed, because its logits give the next token."""
        return (self.num_tokens - 1) // block_size

    def get_block_hashes(self, block_size: int) -> list[bytes]:
        """Hash chain of every full block of all_token_ids, extended incrementally."""
        hashes = self._block_hashes.setdefault(block_size, [])
        num_full = self.num_tokens // block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, self.token_ids_range(i * block_size, (i + 1) * block_size))
            hashes.append(parent)
        return hashes


def check_stop(request: Request) -> RequestStatus | None:
    """The finish status the last appended token causes, or None; records stop_kind and stop_token_id.

    The only place a request's stop is decided: the gateway trims text by the stop kind it is sent.
    """
    if not request.output_token_ids:
        return None
    last = request.output_token_ids[-1]
    # Before min_tokens the worker masks EOS and stop ids; the check stays here too so that no sampler
    # can end a request early.
    if len(request.output_token_ids) <= request.sampling.min_tokens:
        return RequestStatus.FINISHED_LENGTH if len(request.output_token_ids) >= request.max_tokens else None
    if not request.sampling.ignore_eos and last in request.eos_token_ids:
        request.stop_kind = scheduler_pb2.STOP_KIND_EOS
        return RequestStatus.FINISHED_STOPPED
    if last in request.stop_token_ids:
        request.stop_token_id = last
        request.stop_kind = scheduler_pb2.STOP_KIND_STOP_TOKEN
        return RequestStatus.FINISHED_STOPPED
    if len(request.output_token_ids) >= request.max_tokens:
        request.stop_kind = scheduler_pb2.STOP_KIND_LENGTH
        return RequestStatus.FINISHED_LENGTH
    return None
