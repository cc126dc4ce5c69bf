"""StreamOut: one message per event-loop turn, releases on final events, ends after half-close."""

from __future__ import annotations

import asyncio

import grpc

from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from services.common.sampling_checks import InvalidField
from services.scheduler.submissions import Failure, StreamOut


def _tokens(*ids: int, final: bool = False) -> scheduler_pb2.TokenEvent:
    reason = sampling_pb2.FINISH_REASON_LENGTH if final else sampling_pb2.FINISH_REASON_UNSPECIFIED
    return scheduler_pb2.TokenEvent(token_ids=ids, finish_reason=reason)


async def test_one_message_per_turn_and_release_on_final() -> None:
    released: list[str] = []
    out = StreamOut(released.append)
    out.owned.update({"a", "b"})
    out.put("a", _tokens(1))
    out.put("b", _tokens(2, final=True))
    out.refuse("a", Failure(grpc.StatusCode.ALREADY_EXISTS, "request_id 'a' is already running"))
    await asyncio.sleep(0)
    first = out.responses.get_nowait()
    assert first is not None
    assert [(e.request_id, e.WhichOneof("kind")) for e in first.events] == [
        ("a", "tokens"),
        ("b", "tokens"),
        ("a", "error"),
    ]
    # b's final event released it; the refusal of a second "a" left the running one alone.
    assert released == ["b"] and out.owned == {"a"}
    out.put("a", Failure(grpc.StatusCode.INTERNAL, "the worker failed"))
    out.closed = True
    await asyncio.sleep(0)
    second = out.responses.get_nowait()
    assert second is not None
    assert second.events[0].error.code == grpc.StatusCode.INTERNAL.value[0]
    assert released == ["b", "a"]
    # Half-closed with nothing left: the stream ends.
    assert out.responses.get_nowait() is None


def test_invalid_field_failure_names_the_field() -> None:
    failure = Failure.invalid(InvalidField("sampling.top_p", "must be in (0, 1]"))
    proto = failure.to_proto()
    assert (proto.code, proto.field, proto.description) == (3, "sampling.top_p", "must be in (0, 1]")
    assert proto.message == "sampling.top_p: must be in (0, 1]"


async def test_a_caller_that_stops_reading_is_cut_off_at_the_bound() -> None:
    out = StreamOut(lambda _: None, max_unread=3)
    out.owned.add("a")
    for i in range(10):
        out.put("a", _tokens(i))
        await asyncio.sleep(0)
    # Three unread messages, then the end marker: nothing more is queued, however long the request runs.
    assert out.overflowed
    assert out.responses.qsize() == 4
    queued = [out.responses.get_nowait() for _ in range(4)]
    assert all(r is not None for r in queued[:3]) and queued[3] is None
    out.put("a", _tokens(99, final=True))
    await asyncio.sleep(0)
    assert out.responses.empty()
