"""W3C trace context, the monotonic-to-epoch conversion and the spans built from them (services/common/tracing.py)."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.common.proto.meshserve.v1 import sampling_pb2
from services.common.tracing import (
    MAX_TRACESTATE_CHARS,
    MonotonicClock,
    RequestSpan,
    TraceContext,
    Tracing,
    new_trace,
    parse_traceparent,
    trace_context_from,
    trace_id_of,
)
from services.scheduler.request import Request
from services.scheduler.request_log import RequestLog
from services.scheduler.submissions import Submission

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


def test_a_traceparent_round_trips() -> None:
    context = parse_traceparent(TRACEPARENT)
    assert context == TraceContext(TRACE_ID, SPAN_ID, 0x01)
    assert context.sampled
    assert context.traceparent == TRACEPARENT
    unsampled = parse_traceparent(f"00-{TRACE_ID}-{SPAN_ID}-00")
    assert unsampled is not None and not unsampled.sampled
    assert unsampled.traceparent.endswith("-00")


def test_a_later_version_is_read_as_version_00() -> None:
    # The spec's forward compatibility: a reader takes the four fields it knows and ignores what follows.
    context = parse_traceparent(f"01-{TRACE_ID}-{SPAN_ID}-01-what-comes-next")
    assert context == TraceContext(TRACE_ID, SPAN_ID, 0x01)
    assert context.traceparent == TRACEPARENT


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        TRACEPARENT.upper(),  # hex must be lowercase
        f"00-{TRACE_ID}-{SPAN_ID}-01-extra",  # version 00 has exactly four fields
        f"ff-{TRACE_ID}-{SPAN_ID}-01",  # version ff is forbidden
        f"00-{'0' * 32}-{SPAN_ID}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01",  # short trace id
        f"00-{TRACE_ID}-{SPAN_ID}0-01",  # long parent id
        f"00-{TRACE_ID}-{SPAN_ID}-1",  # one-digit flags
        f"00-{TRACE_ID.replace('4', 'g')}-{SPAN_ID}-01",  # not hex
        f"00_{TRACE_ID}_{SPAN_ID}_01",
        f"0-{TRACE_ID}-{SPAN_ID}-01",
    ],
)
def test_an_invalid_traceparent_is_ignored(value: str | None) -> None:
    assert parse_traceparent(value, "vendor=value") is None
    assert trace_id_of(value or "") is None


def test_tracestate_is_kept_when_valid_and_dropped_when_not() -> None:
    assert parse_traceparent(TRACEPARENT, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7").tracestate == (  # type: ignore[union-attr]
        "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    )
    assert parse_traceparent(TRACEPARENT, "x" * (MAX_TRACESTATE_CHARS + 1)).tracestate == ""  # type: ignore[union-attr]
    assert parse_traceparent(TRACEPARENT, "a=b\n").tracestate == ""  # type: ignore[union-attr]
    assert parse_traceparent(TRACEPARENT).tracestate == ""  # type: ignore[union-attr]


def test_a_child_keeps_the_trace_and_gets_its_own_span() -> None:
    parent = TraceContext(TRACE_ID, SPAN_ID, 0x00, "rojo=1")
    child = parent.child()
    assert child.trace_id == TRACE_ID
    assert child.span_id != SPAN_ID and len(child.span_id) == 16 and int(child.span_id, 16) != 0
    assert (child.flags, child.tracestate) == (0x00, "rojo=1")
    assert parse_traceparent(child.traceparent) == TraceContext(TRACE_ID, child.span_id, 0x00)


def test_a_new_trace_is_valid_and_sampled() -> None:
    first, second = new_trace(), new_trace()
    assert first.trace_id != second.trace_id
    assert parse_traceparent(first.traceparent) == first
    assert first.sampled


def test_the_context_comes_from_grpc_metadata_or_http_headers() -> None:
    pairs = [("x-request-id", "abc"), ("traceparent", TRACEPARENT), ("tracestate", "a=1"), ("tracestate", "b=2")]
    assert trace_context_from(pairs) == TraceContext(TRACE_ID, SPAN_ID, 0x01, "a=1,b=2")
    assert trace_context_from({"traceparent": TRACEPARENT}) == TraceContext(TRACE_ID, SPAN_ID, 0x01)
    # Two traceparents: which one is meant is unknown, so neither.
    assert trace_context_from([("traceparent", TRACEPARENT), ("traceparent", TRACEPARENT)]) is None
    assert trace_context_from([("traceparent-bin", b"\x00")]) is None
    assert trace_context_from(None) is None


def test_monotonic_times_convert_to_epoch_nanoseconds_with_one_offset() -> None:
    clock = MonotonicClock(epoch_ns=1_700_000_000_000_000_000, monotonic_ns=5_000_000_000)
    assert clock.epoch_ns(5.0) == 1_700_000_000_000_000_000
    assert clock.epoch_ns(6.25) - clock.epoch_ns(5.0) == 1_250_000_000
    assert clock.epoch_ns(4.999_999_999) == 1_700_000_000_000_000_000 - 1
    # Taken from the clocks now: the conversion of now is now (to well within a second).
    live = MonotonicClock()
    assert abs(live.epoch_ns(time.monotonic()) - time.time_ns()) < 1_000_000_000


def test_without_an_endpoint_nothing_records_but_the_context_travels() -> None:
    tracing = Tracing("gateway")
    assert not tracing.enabled
    span = tracing.start_server_span("generate", TraceContext(TRACE_ID, SPAN_ID))
    assert type(span) is RequestSpan and not span.recording
    assert span.trace_id == TRACE_ID and span.context.span_id != SPAN_ID
    span.set_error("ignored")
    span.end()
    assert tracing.start_server_span("generate", None).context.sampled
    tracing.record_span("queue", span.context, 1.0, 2.0)  # a no-op


def _recording(service: str) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(service, provider), exporter


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


async def test_the_server_span_is_the_clients_child_and_names_the_next_hops_parent() -> None:
    tracing, exporter = _recording("gateway")
    span = tracing.start_server_span("generate", TraceContext(TRACE_ID, SPAN_ID, 0x01, "rojo=1"))
    assert span.recording and span.trace_id == TRACE_ID
    span.set_attributes({"meshserve.request_id": "r1"})
    span.set_error("INVALID_ARGUMENT: no")
    span.end()
    (done,) = exporter.get_finished_spans()
    assert done.kind is SpanKind.SERVER
    assert done.parent is not None and f"{done.parent.span_id:016x}" == SPAN_ID and done.parent.is_remote
    assert f"{done.context.span_id:016x}" == span.context.span_id
    assert done.context.trace_state.get("rojo") == "1"
    assert done.status.status_code is StatusCode.ERROR
    assert done.attributes is not None and done.attributes["meshserve.request_id"] == "r1"
    # A request without a traceparent starts a trace of its own.
    root = tracing.start_server_span("generate", None)
    root.end()
    assert exporter.get_finished_spans()[-1].parent is None
    await tracing.shutdown()
    assert not tracing.enabled


def test_the_scheduler_phases_are_spans_with_the_times_they_happened() -> None:
    tracing, exporter = _recording("scheduler")
    parent = TraceContext(TRACE_ID, SPAN_ID)
    request = Request("r1", [1, 2, 3], sampling_pb2.SamplingParams(), [0], 8, arrival_time=100.0, trace=parent)
    request.first_scheduled_at = 100.5
    request.output_token_ids = [4, 5]
    request.worker_id = "w0"
    sub = Submission(request, lambda _id, _item: None, first_token_at=101.0)
    RequestLog(tracing).finished(sub, sampling_pb2.FINISH_REASON_LENGTH, 103.0)
    spans = _by_name(exporter.get_finished_spans())
    assert set(spans) == {"queue", "prefill", "decode"}
    clock = tracing.clock
    for name, start, end in (("queue", 100.0, 100.5), ("prefill", 100.5, 101.0), ("decode", 101.0, 103.0)):
        span = spans[name]
        assert (span.start_time, span.end_time) == (clock.epoch_ns(start), clock.epoch_ns(end)), name
        assert span.parent is not None and f"{span.parent.span_id:016x}" == SPAN_ID
        assert f"{span.context.trace_id:032x}" == TRACE_ID
    decode = spans["decode"].attributes
    assert decode is not None
    assert decode["gen_ai.usage.output_tokens"] == 2
    assert tuple(decode["gen_ai.response.finish_reasons"]) == ("FINISH_REASON_LENGTH",)  # type: ignore[arg-type]


def test_a_request_that_never_ran_has_only_its_queue_span() -> None:
    tracing, exporter = _recording("scheduler")
    request = Request("r1", [1, 2, 3], sampling_pb2.SamplingParams(), [0], 8, arrival_time=time.monotonic())
    RequestLog(tracing).aborted(Submission(request, lambda _id, _item: None), "r1")
    (queue,) = exporter.get_finished_spans()
    assert queue.name == "queue"
    assert queue.end_time is not None and queue.start_time is not None and queue.end_time >= queue.start_time
    # Without a traceparent the scheduler made a trace of its own for the request.
    assert f"{queue.context.trace_id:032x}" == request.trace_id
