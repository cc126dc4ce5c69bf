"""Admission: a submission becomes a Request, or a typed failure. Pure: no queues, no gRPC calls.

The only place max_tokens is resolved and a submission's limits are checked against what the workers
reported; the gateway checks the same caps (sampling_checks) only to answer early.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from services.common.grpc_server import MAX_MESSAGE_BYTES
from services.common.proto.meshserve.v1 import scheduler_pb2
from services.common.request_context import MAX_REQUEST_ID_CHARS
from services.common.sampling_checks import (
    InvalidField,
    check_eos_token_ids,
    check_prompt_length,
    check_sampling,
    check_token_ids,
    resolve_max_tokens,
)
from services.common.tracing import parse_traceparent
from services.scheduler.request import Request
from services.scheduler.submissions import Failure

# One submission's share of an internal message: it travels on in a Step beside others, and the planner
# keeps a Step's new requests under half the limit (worker_scheduler.STEP_NEW_REQUEST_BYTES), so one
# request accepted here can always be sent to a worker.
MAX_SUBMISSION_BYTES = MAX_MESSAGE_BYTES // 8


@dataclass(frozen=True)
class ModelLimits:
    """What every ready worker can do: the bounds a submission must fit."""

    max_model_len: int
    vocab_size: int
    # Longest sequence (prompt + max_tokens) that fits in every ready worker's KV cache.
    max_sequence_tokens: int


def admit(submit: scheduler_pb2.SubmitRequest, limits: ModelLimits, now: float | None = None) -> Request | Failure:
    """Check a submission and build its Request."""
    now = time.monotonic() if now is None else now
    try:
        max_tokens = _check(submit, limits)
    except InvalidField as err:
        return Failure.invalid(err)
    deadline = None
    if submit.HasField("timeout_seconds"):
        if submit.timeout_seconds <= 0:
            return Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it was queued")
        deadline = now + submit.timeout_seconds
    return Request(
        submit.request_id,
        list(submit.prompt_token_ids),
        submit.sampling,
        list(submit.eos_token_ids),
        max_tokens,
        arrival_time=now,
        deadline=deadline,
        # An invalid traceparent is ignored like a missing one: the request gets a trace of its own.
        trace=parse_traceparent(submit.traceparent),
    )


def _check(submit: scheduler_pb2.SubmitRequest, limits: ModelLimits) -> int:
    """Raise InvalidField for the first bad field; returns the resolved max_tokens."""
    size = submit.ByteSize()
    if size > MAX_SUBMISSION_BYTES:
        raise InvalidField("request", f"is {size} bytes; a submission may be at most {MAX_SUBMISSION_BYTES}")
    if not submit.request_id:
        raise InvalidField("request_id", "is empty; the caller must choose a unique id")
    if len(submit.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidField("request_id", f"is {len(submit.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    check_eos_token_ids(submit.eos_token_ids)
    # Lengths before contents: a huge list is refused without walking it.
    check_prompt_length(len(submit.prompt_token_ids), limits.max_model_len, "prompt_token_ids")
    check_token_ids(submit.prompt_token_ids, limits.vocab_size, "prompt_token_ids")
    check_eos_token_ids(submit.eos_token_ids, limits.vocab_size)
    check_sampling(submit.sampling, limits.vocab_size)
    # Unset max_tokens means "as many as fit": in the model length and in every worker's KV cache. A
    # max_tokens that is set is capped by the model length only; past the KV cache it is refused below.
    room = limits.max_model_len
    if not submit.sampling.HasField("max_tokens"):
        room = min(room, limits.max_sequence_tokens)
    max_tokens = resolve_max_tokens(submit.sampling, len(submit.prompt_token_ids), room)
    if max_tokens < 1:
        raise InvalidField(
            "prompt_token_ids",
            f"the prompt of {len(submit.prompt_token_ids)} tokens leaves no room to generate in a worker's KV "
            f"cache ({limits.max_sequence_tokens} tokens); shorten it",
        )
    if submit.sampling.min_tokens > max_tokens:
        raise InvalidField(
            "sampling.min_tokens",
            f"min_tokens ({submit.sampling.min_tokens}) is more than the {max_tokens} tokens the request may "
            "generate; lower it",
        )
    total = len(submit.prompt_token_ids) + max_tokens
    if total > limits.max_sequence_tokens:
        raise InvalidField(
            "sampling.max_tokens",
            f"prompt + max_tokens = {total} tokens do not fit in a worker's KV cache; "
            "lower max_tokens or give workers more --kv-cache-memory",
        )
    return max_tokens
