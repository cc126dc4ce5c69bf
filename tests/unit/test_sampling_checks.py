"""The caps every hop checks (services/common/sampling_checks.py) and the statuses errors.py builds."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from services.common.errors import request_error_status, retry_status
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from services.common.sampling_checks import (
    MAX_EOS_TOKEN_IDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidField,
    check_eos_token_ids,
    check_sampling,
)


def _field(params: sampling_pb2.SamplingParams) -> str:
    with pytest.raises(InvalidField) as info:
        check_sampling(params, vocab_size=100)
    return info.value.field


def test_caps_at_and_over_the_limit() -> None:
    check_sampling(
        sampling_pb2.SamplingParams(
            stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS
        ),
        vocab_size=100,
    )
    assert _field(sampling_pb2.SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))) == "sampling.stop"
    assert _field(sampling_pb2.SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])) == "sampling.stop[0]"
    assert _field(sampling_pb2.SamplingParams(stop=[""])) == "sampling.stop[0]"
    # The count is checked before the ids, so a huge list costs nothing to refuse.
    assert _field(sampling_pb2.SamplingParams(stop_token_ids=[1000] * (MAX_STOP_TOKEN_IDS + 1))) == (
        "sampling.stop_token_ids"
    )


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_logprobs": 21, "logprobs": True}, "sampling.top_logprobs"),
        ({"top_logprobs": 5}, "sampling.top_logprobs"),  # needs logprobs
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "sampling.repetition_penalty"),
        ({"frequency_penalty": 2.5}, "sampling.frequency_penalty"),
        ({"presence_penalty": -3.0}, "sampling.presence_penalty"),
        ({"min_p": 1.5}, "sampling.min_p"),
        ({"min_tokens": -1}, "sampling.min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "sampling.min_tokens"),
        ({"logit_bias": {100: 1.0}}, "sampling.logit_bias[100]"),
        ({"logit_bias": {3: 101.0}}, "sampling.logit_bias[3]"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "sampling.logit_bias"),
    ],
)
def test_sampling_extras_out_of_range(params: dict[str, object], field: str) -> None:
    assert _field(sampling_pb2.SamplingParams(**params)) == field  # type: ignore[arg-type]


def test_sampling_extras_in_range() -> None:
    check_sampling(
        sampling_pb2.SamplingParams(
            logprobs=True,
            top_logprobs=20,
            repetition_penalty=1.3,
            frequency_penalty=-2.0,
            presence_penalty=2.0,
            min_p=0.05,
            min_tokens=4,
            max_tokens=4,
            logit_bias={0: -100.0, 99: 100.0},
        ),
        vocab_size=100,
    )


def test_eos_ids() -> None:
    check_eos_token_ids([0] * MAX_EOS_TOKEN_IDS, vocab_size=10)
    with pytest.raises(InvalidField, match="at most 64"):
        check_eos_token_ids([0] * (MAX_EOS_TOKEN_IDS + 1))
    with pytest.raises(InvalidField, match=r"eos_token_ids\[1\]"):
        check_eos_token_ids([0, 10], vocab_size=10)


def _details(status: grpc.Status) -> status_pb2.Status:
    (value,) = [v for k, v in status.trailing_metadata if k == "grpc-status-details-bin"]
    return status_pb2.Status.FromString(value)


def test_retry_info_carried_and_omitted() -> None:
    status = retry_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", 1.25)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED and status.details == "full"
    info = error_details_pb2.RetryInfo()
    assert _details(status).details[0].Unpack(info)
    assert info.retry_delay.ToNanoseconds() == 1_250_000_000
    # Without advice only the ErrorInfo remains, with the code's default reason.
    (only,) = _details(retry_status(grpc.StatusCode.UNAVAILABLE, "gone", 0)).details
    reason = error_details_pb2.ErrorInfo()
    assert only.Unpack(reason) and reason.reason == "SCHEDULER_UNAVAILABLE" and reason.domain == "meshserve.v1"


def test_request_error_status() -> None:
    invalid = request_error_status(
        scheduler_pb2.RequestError(code=3, message="x", field="sampling.max_tokens", description="too many")
    )
    bad = error_details_pb2.BadRequest()
    assert invalid.code == grpc.StatusCode.INVALID_ARGUMENT and _details(invalid).details[0].Unpack(bad)
    assert bad.field_violations[0].field == "sampling.max_tokens"
    busy = request_error_status(scheduler_pb2.RequestError(code=8, message="queue full", retry_after_seconds=2))
    assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED and busy.details == "queue full"
    assert _details(busy).details[0].Unpack(error_details_pb2.RetryInfo())
    assert request_error_status(scheduler_pb2.RequestError(code=4, message="late")).code == (
        grpc.StatusCode.DEADLINE_EXCEEDED
    )
    slow = request_error_status(scheduler_pb2.RequestError(code=8, message="slow", reason="CLIENT_TOO_SLOW"))
    info = error_details_pb2.ErrorInfo()
    assert _details(slow).details[-1].Unpack(info) and info.reason == "CLIENT_TOO_SLOW"
