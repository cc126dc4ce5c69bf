"""Traces that follow a request: W3C trace context across hops, and OpenTelemetry spans with --otlp-endpoint.

One home for three things every service needs the same way:

- `traceparent` parse and format (https://www.w3.org/TR/trace-context/). The gateway takes the client's,
  makes its own span a child of it (or starts a trace), and sends that on in `SubmitRequest.traceparent`;
  the scheduler forwards it in `NewRequest.traceparent`. Every per-request log line carries its trace id.
- OpenTelemetry spans exported over OTLP/gRPC (`Tracing`), only when --otlp-endpoint is given. Without it
  no SDK is imported and no provider exists: a span is a context and nothing else.
- Converting `time.monotonic()` (what the services time requests with) to the epoch nanoseconds spans
  need, with one offset taken at startup, so a span built at a request's end has the times it happened.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = structlog.get_logger()

TRACEPARENT_KEY = "traceparent"
TRACESTATE_KEY = "tracestate"
# trace-flags bit 0: the caller records this trace (the SDK's parent-based sampler follows it).
SAMPLED = 0x01
# W3C: a tracestate of more than 512 characters may be dropped whole; we do, and anything unprintable.
MAX_TRACESTATE_CHARS = 512

# version "00": exactly version-trace_id-parent_id-flags, lowercase hex. A later version may append fields
# after a "-", which a version-00 reader ignores (the spec's forward compatibility rule).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL)
_TRACESTATE = re.compile(r"[\x20-\x7e]*")
_ZERO_TRACE_ID = "0" * 32
_ZERO_SPAN_ID = "0" * 16

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float] | Sequence[bool]
Attributes = Mapping[str, AttributeValue]


@dataclass(frozen=True, slots=True)
class TraceContext:
    """One span's place in a trace: what `traceparent` carries, plus the caller's `tracestate`."""

    # 32 lowercase hex digits, never all zeros.
    trace_id: str
    # 16 lowercase hex digits, never all zeros: the span this context names (the parent of its children).
    span_id: str
    flags: int = SAMPLED
    # Vendor data the client sent beside its traceparent, passed to the SDK as is ("" for none).
    tracestate: str = ""

    @property
    def traceparent(self) -> str:
        """The W3C traceparent header value (version 00)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def child(self) -> TraceContext:
        """A new span in the same trace (same flags and tracestate)."""
        return TraceContext(self.trace_id, _random_span_id(), self.flags, self.tracestate)


def new_trace() -> TraceContext:
    """A fresh trace's root context (sampled): for a request that came without a traceparent."""
    trace_id = _ZERO_TRACE_ID
    while trace_id == _ZERO_TRACE_ID:
        trace_id = f"{random.getrandbits(128):032x}"
    return TraceContext(trace_id, _random_span_id())


def _random_span_id() -> str:
    span_id = _ZERO_SPAN_ID
    while span_id == _ZERO_SPAN_ID:
        span_id = f"{random.getrandbits(64):016x}"
    return span_id


def parse_traceparent(value: str | None, tracestate: str | None = None) -> TraceContext | None:
    """The context a traceparent names, or None when it is absent or invalid (never an error: a bad header
    from a client starts a new trace rather than failing its request). An invalid tracestate is dropped."""
    if not value:
        return None
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == _ZERO_TRACE_ID or span_id == _ZERO_SPAN_ID:
        return None
    return TraceContext(trace_id, span_id, int(flags, 16), _checked_tracestate(tracestate))


def _checked_tracestate(value: str | None) -> str:
    if not value:
        return ""
    value = value.strip(" \t")
    if len(value) > MAX_TRACESTATE_CHARS or not _TRACESTATE.fullmatch(value):
        return ""
    return value


def trace_id_of(traceparent: str) -> str | None:
    """The trace id of a traceparent (None when it is absent or invalid): what a log line needs of it."""
    context = parse_traceparent(traceparent)
    return context.trace_id if context is not None else None


def trace_context_from(metadata: Mapping[str, str] | Sequence[tuple[str, str | bytes]] | None) -> TraceContext | None:
    """The caller's context from gRPC metadata (pairs) or HTTP headers (a case-insensitive mapping)."""
    if metadata is None:
        return None
    if isinstance(metadata, Mapping):
        return parse_traceparent(metadata.get(TRACEPARENT_KEY), metadata.get(TRACESTATE_KEY))
    found: dict[str, str] = {}
    for key, value in metadata:
        if key in (TRACEPARENT_KEY, TRACESTATE_KEY) and isinstance(value, str):
            # W3C: several tracestate headers combine into one list; a second traceparent makes it invalid.
            if key == TRACEPARENT_KEY and key in found:
                return None
            found[key] = f"{found[key]},{value}" if key in found else value
    return parse_traceparent(found.get(TRACEPARENT_KEY), found.get(TRACESTATE_KEY))


class MonotonicClock:
    """time.monotonic() seconds to epoch nanoseconds, with one offset taken when it is made (at startup).

    One offset, not a time.time() call per conversion: the phases of one request must keep the order and
    the lengths the monotonic clock measured, whatever NTP does to the wall clock meanwhile."""

    def __init__(self, epoch_ns: int | None = None, monotonic_ns: int | None = None) -> None:
        wall = time.time_ns() if epoch_ns is None else epoch_ns
        mono = time.monotonic_ns() if monotonic_ns is None else monotonic_ns
        self.offset_ns = wall - mono

    def epoch_ns(self, monotonic_s: float) -> int:
        """The epoch time in nanoseconds of a time.monotonic() reading."""
        return self.offset_ns + round(monotonic_s * 1e9)


class RequestSpan:
    """A request's span as a service sees it: its context always, and (subclass) an SDK span when recording.

    This base is what runs without --otlp-endpoint: every method is a no-op, so callers need no checks."""

    __slots__ = ("context",)
    recording = False

    def __init__(self, context: TraceContext) -> None:
        self.context = context

    @property
    def trace_id(self) -> str:
        return self.context.trace_id

    def set_attributes(self, attributes: Attributes) -> None:
        """Add attributes (call only when `recording`, so that nothing is built for nothing)."""

    def set_error(self, description: str) -> None:
        """Mark the span failed."""

    def end(self) -> None:
        """End the span now (once)."""


class _SdkSpan(RequestSpan):
    __slots__ = ("_span",)
    recording = True

    def __init__(self, span: Span, tracestate: str) -> None:
        ctx = span.get_span_context()
        super().__init__(TraceContext(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", int(ctx.trace_flags), tracestate))
        self._span = span

    def set_attributes(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def set_error(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, description))

    def end(self) -> None:
        self._span.end()


class Tracing:
    """A service's tracer: an SDK TracerProvider with a batch OTLP exporter, or (provider None) nothing."""

    def __init__(self, service: str, provider: TracerProvider | None = None) -> None:
        self.service = service
        self._provider = provider
        self._tracer: Tracer | None = provider.get_tracer(f"meshserve.{service}") if provider is not None else None
        self.clock = MonotonicClock()

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded and exported (--otlp-endpoint is set)."""
        return self._tracer is not None

    def start_server_span(self, name: str, parent: TraceContext | None) -> RequestSpan:
        """A request's span at the service's edge (SERVER kind), a child of the caller's context or the root
        of a new trace. Its context is what the next hop's traceparent carries, recording or not."""
        if self._tracer is None:
            return RequestSpan(parent.child() if parent is not None else new_trace())
        from opentelemetry.trace import SpanKind

        span = self._tracer.start_span(name, context=_otel_context(parent), kind=SpanKind.SERVER)
        return _SdkSpan(span, parent.tracestate if parent is not None else "")

    def record_span(
        self,
        name: str,
        parent: TraceContext,
        start_monotonic: float,
        end_monotonic: float,
        attributes: Attributes | None = None,
        error: str | None = None,
    ) -> None:
        """Export a finished span with the times it happened (built afterwards: nothing runs per token)."""
        if self._tracer is None:
            return
        span = self._tracer.start_span(
            name,
            context=_otel_context(parent),
            attributes=attributes,
            start_time=self.clock.epoch_ns(start_monotonic),
        )
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.clock.epoch_ns(max(start_monotonic, end_monotonic)))

    async def shutdown(self) -> None:
        """Export what is queued and stop the exporter (at service stop; off the event loop, since an
        unreachable collector makes the last export wait out its timeout)."""
        if self._provider is None:
            return
        provider, self._provider, self._tracer = self._provider, None, None
        await asyncio.to_thread(provider.shutdown)


def _otel_context(parent: TraceContext | None) -> Context:
    """An SDK context whose current span is the remote parent (an empty one for a root: never the ambient
    context, which no meshserve code sets)."""
    from opentelemetry.context import Context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState, set_span_in_context

    if parent is None:
        return Context()
    state = TraceState.from_header([parent.tracestate]) if parent.tracestate else None
    span_context = SpanContext(
        int(parent.trace_id, 16),
        int(parent.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(parent.flags),
        trace_state=state,
    )
    return set_span_in_context(NonRecordingSpan(span_context), Context())


# Seconds the exporter waits for the collector per batch; the default 10 s would hold up a stopping service.
EXPORT_TIMEOUT_S = 5.0


def setup_tracing(service: str, endpoint: str | None) -> Tracing:
    """The service's Tracing: with an endpoint (`http://collector:4317`; https for TLS) an SDK provider whose
    resource is service.name=meshserve-<service> and whose spans leave in batches over OTLP/gRPC; without
    one, nothing is imported or installed. The provider is the service's own, never the global one."""
    if not endpoint:
        return Tracing(service)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"meshserve-{service}"}))
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing", otlp_endpoint=endpoint, service_name=f"meshserve-{service}")
    return Tracing(service, provider)
