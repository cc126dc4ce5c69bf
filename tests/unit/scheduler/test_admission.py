"""Admission: one place resolves max_tokens and checks a submission against the workers' limits."""

from __future__ import annotations

import grpc
import pytest

from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from services.common.request_context import MAX_REQUEST_ID_CHARS
from services.common.sampling_checks import MAX_EOS_TOKEN_IDS, MAX_STOP_TOKEN_IDS
from services.scheduler.admission import ModelLimits, admit
from services.scheduler.request import Request
from services.scheduler.submissions import Failure

LIMITS = ModelLimits(max_model_len=100, vocab_size=50, max_sequence_tokens=80)


def submit(**kwargs: object) -> scheduler_pb2.SubmitRequest:
    fields: dict[str, object] = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "eos_token_ids": [2]}
    fields.update(kwargs)
    return scheduler_pb2.SubmitRequest(**fields)  # type: ignore[arg-type]


def test_unset_max_tokens_is_the_room_left() -> None:
    req = admit(submit(), ModelLimits(100, 50, 100), now=5.0)
    assert isinstance(req, Request)
    assert req.max_tokens == 97
    assert req.arrival_time == 5.0 and req.deadline is None


def test_max_tokens_within_the_model_length_is_kept() -> None:
    req = admit(submit(sampling=sampling_pb2.SamplingParams(max_tokens=10)), LIMITS)
    assert isinstance(req, Request) and req.max_tokens == 10


def test_max_tokens_past_the_model_length_is_refused_naming_both_numbers() -> None:
    # vLLM and OpenAI refuse it; clamping would end the answer early without saying why.
    failure = admit(submit(sampling=sampling_pb2.SamplingParams(max_tokens=98)), ModelLimits(100, 50, 1000))
    assert isinstance(failure, Failure) and failure.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failure.field == "sampling.max_tokens"
    assert "3 tokens" in failure.message and "98" in failure.message and "--max-model-len 100" in failure.message
    assert isinstance(
        admit(submit(sampling=sampling_pb2.SamplingParams(max_tokens=97)), ModelLimits(100, 50, 100)), Request
    )


def test_min_tokens_beyond_what_may_be_generated_is_refused() -> None:
    failure = admit(submit(sampling=sampling_pb2.SamplingParams(min_tokens=78)), LIMITS)  # 77 fit the KV cache
    assert isinstance(failure, Failure) and failure.field == "sampling.min_tokens"
    assert isinstance(admit(submit(sampling=sampling_pb2.SamplingParams(min_tokens=77)), LIMITS), Request)


def test_deadline_is_relative_to_arrival() -> None:
    req = admit(submit(timeout_seconds=2.5, sampling=sampling_pb2.SamplingParams(max_tokens=4)), LIMITS, now=10.0)
    assert isinstance(req, Request) and req.deadline == 12.5


def test_unset_max_tokens_fits_the_kv_cache() -> None:
    req = admit(submit(), LIMITS)
    assert isinstance(req, Request) and req.max_tokens == 77


def test_expired_deadline_is_never_admitted() -> None:
    failure = admit(submit(timeout_seconds=0.0), LIMITS)
    assert isinstance(failure, Failure) and failure.code is grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": "x" * (MAX_REQUEST_ID_CHARS + 1)}, "request_id"),
        ({"eos_token_ids": [1] * (MAX_EOS_TOKEN_IDS + 1)}, "eos_token_ids"),
        ({"eos_token_ids": [99]}, "eos_token_ids[0]"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 100}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 80}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 50]}, "prompt_token_ids[1]"),
        (
            {"sampling": sampling_pb2.SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))},
            "sampling.stop_token_ids",
        ),
        ({"sampling": sampling_pb2.SamplingParams(max_tokens=90)}, "sampling.max_tokens"),
    ],
)
def test_bad_submissions_name_the_field(kwargs: dict[str, object], field: str) -> None:
    failure = admit(submit(**kwargs), LIMITS)
    assert isinstance(failure, Failure)
    assert failure.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failure.field == field


def test_a_submission_too_big_for_a_step_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.scheduler import admission

    monkeypatch.setattr(admission, "MAX_SUBMISSION_BYTES", 64)
    failure = admit(submit(prompt_token_ids=[1] * 200), ModelLimits(1000, 50, 1000))
    assert isinstance(failure, Failure) and failure.field == "request"
