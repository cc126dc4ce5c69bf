"""Logs and traces that follow a request: every service's lines carry its request_id and trace_id, and the
gateway's and scheduler's spans reach an OTLP collector as one trace under the client's span."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import generation_pb2
from tests.support.suite import Suite, start_suite

POLL_TIMEOUT_S = 60.0
Record = dict[str, object]


@dataclass(frozen=True)
class ExportedSpan:
    """One span as the collector received it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver, in-process: it keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ExportedSpan] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ExportedSpan(
                            service=str(resource.get("service.name")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str) -> list[ExportedSpan]:
        with self._lock:
            return [s for s in self._spans if s.trace_id == trace_id]


@dataclass
class TracedSuite:
    suite: Suite
    collector: Collector
    # The gateway's OpenAI HTTP front.
    http_port: int


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedSuite]:
    collector = Collector()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http_port = free_port()
    try:
        suite = start_suite(
            tiny_model_dir,
            tmp_path_factory.mktemp("logs"),
            worker_args=["--kv-cache-memory", "64MiB"],
            gateway_args=["--http-port", str(http_port)],
            common_args=["--otlp-endpoint", f"http://127.0.0.1:{port}"],
        )
        try:
            yield TracedSuite(suite, collector, http_port)
        finally:
            suite.stop()
    finally:
        server.stop(0)


def _traceparent() -> tuple[str, str, str]:
    """A client's (traceparent, trace id, span id)."""
    trace_id, span_id = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


async def _poll(what: str, found: Callable[[], bool]) -> None:
    """Wait until found() holds (logs and spans are written asynchronously); never a fixed sleep."""
    deadline = asyncio.get_running_loop().time() + POLL_TIMEOUT_S
    while not found():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def _lines(suite: Suite, service: str, **match: object) -> list[Record]:
    return [r for r in suite.log_records(service) if all(r.get(k) == v for k, v in match.items())]


async def _collect(call: Any) -> list[generation_pb2.GenerateResponse]:
    return [response async for response in call]


async def test_a_request_is_followed_through_every_service(traced: TracedSuite) -> None:
    suite, collector = traced.suite, traced.collector
    traceparent, trace_id, client_span_id = _traceparent()
    params = sampling_params(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with GenerationClient(suite.address) as client:
        traced_call = client.stub.Generate(
            build_request(token_ids=list(range(20, 60)), sampling=params),
            metadata=(("traceparent", traceparent), ("tracestate", "meshserve-test=1")),
        )
        # Beside it, a request without a traceparent: it gets a trace of its own.
        plain_call = client.stub.Generate(build_request(token_ids=list(range(30, 50)), sampling=params))
        traced_responses, _ = await asyncio.gather(_collect(traced_call), _collect(plain_call))
    assert sum(len(r.token_ids) for r in traced_responses) == 8

    # The gateway: its lines carry the client's trace id; its own request id is what the scheduler sees (n=1).
    await _poll("the gateway's lines", lambda: bool(_lines(suite, "gateway", trace_id=trace_id, event="finished")))
    gateway = _lines(suite, "gateway", trace_id=trace_id)
    request_ids = {r["request_id"] for r in gateway}
    assert len(request_ids) == 1
    (request_id,) = request_ids
    assert {"generate", "finished", "rpc"} <= {r["event"] for r in gateway}
    (access,) = [r for r in gateway if r["event"] == "rpc"]
    assert access["grpc_method"] == "meshserve.v1.Generation/Generate" and access["grpc_code"] == "OK"
    assert access["prompt_tokens"] == 40 and access["completion_tokens"] == 8

    # The scheduler and the worker name it and its trace on each of their lines about it.
    ids = {"request_id": request_id, "trace_id": trace_id}
    await _poll("the scheduler's lines", lambda: bool(_lines(suite, "scheduler", event="finished", **ids)))
    scheduler = {r["event"]: r for r in _lines(suite, "scheduler", **ids)}
    assert scheduler["submitted"]["prompt_tokens"] == 40 and scheduler["submitted"]["worker"] == "worker-0"
    finished = scheduler["finished"]
    assert finished["finish_reason"] == "FINISH_REASON_LENGTH" and finished["completion_tokens"] == 8
    assert all(isinstance(finished[k], float) for k in ("queue_s", "prefill_s", "decode_s"))
    await _poll("the worker's lines", lambda: bool(_lines(suite, "worker-0", event="request_left", **ids)))
    worker = {r["event"]: r for r in _lines(suite, "worker-0", **ids)}
    assert worker["request_joined"]["prompt_tokens"] == 40 and "num_computed_tokens" in worker["request_joined"]
    assert worker["request_left"]["output_tokens"] == 8

    # The plain request's lines carry a trace id too: a new one, the same in every service.
    plain = [r for r in _lines(suite, "gateway", event="generate") if r["request_id"] != request_id]
    assert plain, "the plain request was not logged"
    plain_trace = str(plain[-1]["trace_id"])
    assert len(plain_trace) == 32 and plain_trace != trace_id
    await _poll(
        "the plain request's scheduler line",
        lambda: bool(_lines(suite, "scheduler", event="finished", trace_id=plain_trace)),
    )

    # Spans: the gateway's generate is the client's child; the scheduler's phases are generate's children.
    names = {"generate", "queue", "prefill", "decode"}
    await _poll("the spans", lambda: names <= {s.name for s in collector.spans(trace_id)})
    spans = {s.name: s for s in collector.spans(trace_id)}
    generate = spans["generate"]
    assert generate.service == "meshserve-gateway"
    assert generate.parent_span_id == client_span_id
    assert generate.kind == 2  # SPAN_KIND_SERVER
    assert generate.attributes["meshserve.request_id"] == request_id
    assert generate.attributes["gen_ai.usage.input_tokens"] == 40
    assert generate.attributes["gen_ai.usage.output_tokens"] == 8
    assert generate.attributes["gen_ai.response.finish_reasons"] == ["FINISH_REASON_LENGTH"]
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase].service == "meshserve-scheduler"
        assert spans[phase].parent_span_id == generate.span_id, phase
        assert spans[phase].attributes["meshserve.request_id"] == request_id
    assert spans["decode"].attributes["gen_ai.usage.output_tokens"] == 8


async def test_a_refused_request_is_logged_with_its_ids(traced: TracedSuite) -> None:
    suite = traced.suite
    traceparent, trace_id, _ = _traceparent()
    # Past the model length: the scheduler's admission refuses it, the gateway answers INVALID_ARGUMENT.
    params = sampling_params(max_tokens=100_000)
    async with GenerationClient(suite.address) as client:
        call = client.stub.Generate(
            build_request(prompt="too long an answer", sampling=params), metadata=(("traceparent", traceparent),)
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _collect(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    failure = {"trace_id": trace_id, "event": "request failed"}
    await _poll("the gateway's failure line", lambda: bool(_lines(suite, "gateway", **failure)))
    (failed,) = _lines(suite, "gateway", **failure)
    assert failed["code"] == "INVALID_ARGUMENT" and failed["request_id"]
    ids = {"request_id": failed["request_id"], "trace_id": trace_id}
    (refused,) = _lines(suite, "scheduler", event="refused", **ids)
    assert refused["code"] == "INVALID_ARGUMENT" and "max_tokens" in str(refused["why"])
    # Written when the call's status has gone out, a moment after the failure line.
    await _poll("the gateway's access line", lambda: bool(_lines(suite, "gateway", event="rpc", **ids)))
    (access,) = _lines(suite, "gateway", event="rpc", **ids)
    assert access["grpc_code"] == "InvalidArgument"  # the access line's spelling (the metrics' code label)
    # Its span says so.
    await _poll("the refused request's span", lambda: bool(traced.collector.spans(trace_id)))
    (span,) = traced.collector.spans(trace_id)
    assert span.name == "generate" and span.attributes["error.type"] == "INVALID_ARGUMENT"


async def test_a_cancelled_request_is_logged_with_its_ids(traced: TracedSuite) -> None:
    suite = traced.suite
    traceparent, trace_id, _ = _traceparent()
    params = sampling_params(max_tokens=400, temperature=0.0, ignore_eos=True)
    async with GenerationClient(suite.address) as client:
        call = client.stub.Generate(
            build_request(token_ids=list(range(20, 120)), sampling=params), metadata=(("traceparent", traceparent),)
        )
        received = 0
        async for _ in call:
            received += 1
            if received == 3:
                break
        call.cancel()
    cancel = {"trace_id": trace_id, "event": "request cancelled"}
    await _poll("the gateway's cancel line", lambda: bool(_lines(suite, "gateway", **cancel)))
    (cancelled,) = _lines(suite, "gateway", **cancel)
    ids = {"request_id": cancelled["request_id"], "trace_id": trace_id}
    await _poll("the scheduler's abort line", lambda: bool(_lines(suite, "scheduler", event="aborted", **ids)))
    await _poll("the worker's leave line", lambda: bool(_lines(suite, "worker-0", event="request_left", **ids)))
    await suite.wait_idle()


async def test_the_http_front_takes_the_traceparent_header(traced: TracedSuite) -> None:
    suite = traced.suite
    traceparent, trace_id, client_span_id = _traceparent()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{traced.http_port}", timeout=120) as http:
        reply = await http.post(
            "/v1/completions",
            json={"prompt": "follow me", "max_tokens": 4, "temperature": 0},
            headers={"traceparent": traceparent},
        )
        assert reply.status_code == 200, reply.text
        # A malformed traceparent is ignored: the request is served, under a trace of its own.
        reply = await http.post(
            "/v1/completions",
            json={"prompt": "follow me", "max_tokens": 1},
            headers={"traceparent": f"00-{trace_id.upper()}-{client_span_id}-01"},
        )
        assert reply.status_code == 200, reply.text
    await _poll("the gateway's lines", lambda: bool(_lines(suite, "gateway", trace_id=trace_id, event="finished")))
    (generate,) = _lines(suite, "gateway", trace_id=trace_id, event="generate")
    ids = {"request_id": generate["request_id"], "trace_id": trace_id}
    await _poll("the scheduler's lines", lambda: bool(_lines(suite, "scheduler", event="finished", **ids)))
    await _poll("the spans", lambda: {"generate", "decode"} <= {s.name for s in traced.collector.spans(trace_id)})
    spans = {s.name: s for s in traced.collector.spans(trace_id)}
    assert spans["generate"].parent_span_id == client_span_id
    assert spans["decode"].parent_span_id == spans["generate"].span_id
