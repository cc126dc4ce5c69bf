"""Client request ids: checked, echoed, never the scheduler's key."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.proto.meshserve.v1 import generation_pb2
from services.common.request_context import MAX_REQUEST_ID_CHARS, check_request_id, is_valid_request_id
from services.common.sampling_checks import InvalidField
from services.gateway.request_ids import request_ids


class _Context:
    def __init__(self, metadata: tuple[tuple[str, Any], ...] = ()) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata


@pytest.mark.parametrize("value", ["a", "trace-abc_1.2:3", "A" * MAX_REQUEST_ID_CHARS])
def test_valid_ids(value: str) -> None:
    check_request_id(value, "request_id")
    assert is_valid_request_id(value)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("x" * (MAX_REQUEST_ID_CHARS + 1), f"limit is {MAX_REQUEST_ID_CHARS}"),
        ("has space", "A-Za-z0-9._:-"),
        ("new\nline", "A-Za-z0-9._:-"),
        ("ünï", "A-Za-z0-9._:-"),
        ("", "A-Za-z0-9._:-"),
    ],
)
def test_invalid_ids(value: str, needle: str) -> None:
    with pytest.raises(InvalidField) as info:
        check_request_id(value, "x-request-id")
    assert info.value.field == "x-request-id" and needle in info.value.description
    assert not is_valid_request_id(value)


def test_internal_id_is_fresh_and_the_public_one_is_the_clients() -> None:
    request = generation_pb2.GenerateRequest(request_id="mine")
    a, b = request_ids(request, _Context()), request_ids(request, _Context())  # type: ignore[arg-type]
    assert a.client == b.client == "mine" and a.public == "mine"
    assert a.internal != b.internal and a.internal != "mine"


def test_metadata_id_is_used_when_the_field_is_empty_and_checked_always() -> None:
    ids = request_ids(generation_pb2.GenerateRequest(), _Context((("x-request-id", "from-header"),)))  # type: ignore[arg-type]
    assert ids.public == "from-header"
    anonymous = request_ids(generation_pb2.GenerateRequest(), _Context())  # type: ignore[arg-type]
    assert anonymous.client is None and anonymous.public == anonymous.internal
    with pytest.raises(InvalidField) as info:
        request_ids(generation_pb2.GenerateRequest(request_id="ok"), _Context((("x-request-id", "b a d"),)))  # type: ignore[arg-type]
    assert info.value.field == "x-request-id"
    with pytest.raises(InvalidField) as info:
        request_ids(generation_pb2.GenerateRequest(request_id="b/a/d"), _Context())  # type: ignore[arg-type]
    assert info.value.field == "request_id"
