"""parse_generate_request: invalid UTF-8 and garbage become ValidationErrors naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.gateway.raw_request import encode_raw_request, parse_generate_request, raw_request_class
from services.gateway.validation import ValidationError

BAD = b"ok \xff\xfe"


def _field(data: bytes) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        parse_generate_request(data)
    return info.value


def test_valid_request_round_trips() -> None:
    req = generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="héllo 🙂")]),
        sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=0.5, stop=["\n"], seed=3),
        request_id="abc",
    )
    assert parse_generate_request(req.SerializeToString()) == req
    assert parse_generate_request(b"") == generation_pb2.GenerateRequest()


def test_encode_raw_request_matches_real_encoding_for_valid_text() -> None:
    data = encode_raw_request(
        prompt="héllo", sampling={"max_tokens": 3, "stop": ["a", "b"], "top_p": 0.5}, request_id="r"
    )
    real = generation_pb2.GenerateRequest(
        prompt="héllo",
        sampling=sampling_pb2.SamplingParams(max_tokens=3, stop=["a", "b"], top_p=0.5),
        request_id="r",
    )
    assert generation_pb2.GenerateRequest.FromString(data) == real
    ids = encode_raw_request(token_ids={"ids": [1, 2, 3]})
    assert list(parse_generate_request(ids).token_ids.ids) == [1, 2, 3]


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"prompt": BAD}, "prompt"),
        ({"request_id": BAD, "prompt": "fine"}, "request_id"),
        (
            {"chat": {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": BAD}]}},
            "chat.messages[1].content",
        ),
        ({"chat": {"messages": [{"role": b"\xc3", "content": "a"}]}}, "chat.messages[0].role"),
        ({"prompt": "fine", "sampling": {"stop": ["ok", BAD], "max_tokens": 2}}, "sampling.stop[1]"),
        (
            {"prompt": "\xe9", "sampling": {"stop": [b"\xe2\x82"]}},
            "sampling.stop[0]",
        ),  # truncated 3-byte char
    ],
)
def test_invalid_utf8_names_the_field(fields: dict, path: str) -> None:
    data = encode_raw_request(**fields)
    with pytest.raises(DecodeError):  # the real message type refuses it: this is why we parse ourselves
        generation_pb2.GenerateRequest.FromString(data)
    err = _field(data)
    assert err.field == path
    assert "not valid UTF-8" in err.description and "send UTF-8 text, or token_ids" in err.description


def test_first_invalid_field_in_field_order() -> None:
    data = encode_raw_request(prompt=BAD, sampling={"stop": [BAD]}, request_id=BAD)
    assert _field(data).field == "prompt"


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff",
        b"\x0a\x05ab",  # prompt claims 5 bytes, only 2 follow
        b"\x22\x02\x08",  # sampling submessage truncated inside
        b"\x08",  # varint field with no value
    ],
)
def test_garbage_is_a_request_error(data: bytes) -> None:
    err = _field(data)
    assert err.field == "request"
    assert "GenerateRequest" in err.description


def test_mirror_is_private() -> None:
    cls = raw_request_class()
    assert cls.DESCRIPTOR.full_name == "meshserve.v1.raw.GenerateRequest"
    assert cls.DESCRIPTOR.fields_by_name["prompt"].type == cls.DESCRIPTOR.fields_by_name["prompt"].TYPE_BYTES
    # The real type is untouched and still rejects bad UTF-8 on its own.
    real = generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"]
    assert real.type == real.TYPE_STRING


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"chat": {"messages": [{"role": "user", "content": b"a"}] * 300 + [{"role": "user", "content": BAD}]}},
         "chat.messages"),
        ({"prompt": b"ok", "sampling": {"stop": [b"s"] * 20 + [BAD]}}, "sampling.stop"),
    ],
)  # fmt: skip
def test_caps_come_before_the_search_for_bad_utf8(fields: dict[str, Any], field: str) -> None:
    # Searching a huge list for its one bad string would hold the event loop; its size is refused first.
    err = _field(encode_raw_request(**fields))
    assert err.field == field and "at most" in err.description
