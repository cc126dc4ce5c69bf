"""Prometheus metrics of the gateway: what a client sees, under vLLM's names and buckets (docs/metrics.md).

The gateway owns the request-level spans a client experiences (time to first token, token intervals,
end to end); the scheduler owns queue, prefill and decode. model_name is added to every series at scrape
time (services/common/metrics/exposition.py).
"""

from __future__ import annotations

import time

import grpc
from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.metrics import buckets
from services.common.metrics.names import metric, status_code_label
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2

# Token counts per request: vLLM's 1-2-5 buckets up to the longest context any model here has.
_TOKEN_COUNTS = buckets.one_two_five(1 << 20)


class GatewayMetrics:
    """All gateway metrics, created once per process."""

    def __init__(self, registry: CollectorRegistry = DEFAULT_REGISTRY) -> None:
        # Where these live, for whatever exposes them.
        self.registry = registry
        self.requests_started = Counter(metric("requests_started"), "Requests accepted", registry=registry)
        self.requests_rejected = Counter(metric("requests_rejected"), "Requests refused as invalid", registry=registry)
        self.requests_refused = Counter(
            metric("requests_refused"),
            "Requests refused before they started (over a concurrency cap, no scheduler ready, draining, rate "
            "limited, unauthenticated)",
            ["reason"],
            registry=registry,
        )
        self.requests_cancelled = Counter(
            metric("requests_cancelled"), "Requests whose client left before they finished", registry=registry
        )
        self.request_errors = Counter(
            metric("request_errors"),
            "Requests that ended with an error status, by gRPC code (Go spelling)",
            ["code"],
            registry=registry,
        )
        self.request_success = Counter(
            metric("request_success"), "Finished requests", ["finished_reason"], registry=registry
        )
        self.prompt_tokens = Counter(
            metric("prompt_tokens"), "Prompt tokens, counted when a sample's prefill is done", registry=registry
        )
        self.generation_tokens = Counter(
            metric("generation_tokens"), "Generated tokens, counted as they are sent", registry=registry
        )
        self.time_to_first_token = Histogram(
            metric("time_to_first_token_seconds"),
            "Arrival at the gateway to the first token sent",
            buckets=buckets.TIME_TO_FIRST_TOKEN,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            metric("inter_token_latency_seconds"),
            "Time between consecutive token messages of one sample",
            buckets=buckets.TOKEN_INTERVAL,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            metric("time_per_output_token_seconds"),
            "Per sample: (last token - first token) / (tokens - 1)",
            buckets=buckets.TOKEN_INTERVAL,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            metric("e2e_request_latency_seconds"),
            "Arrival at the gateway to the last token",
            buckets=buckets.REQUEST_LATENCY,
            registry=registry,
        )
        self.request_prompt_tokens = Histogram(
            metric("request_prompt_tokens"), "Prompt tokens per request", buckets=_TOKEN_COUNTS, registry=registry
        )
        self.request_generation_tokens = Histogram(
            metric("request_generation_tokens"),
            "Generated tokens per sample",
            buckets=_TOKEN_COUNTS,
            registry=registry,
        )
        self.request_params_n = Histogram(
            metric("request_params_n"), "The n request parameter", buckets=buckets.PARAMS_N, registry=registry
        )
        self.request_params_max_tokens = Histogram(
            metric("request_params_max_tokens"),
            "The max_tokens request parameter (as resolved)",
            buckets=_TOKEN_COUNTS,
            registry=registry,
        )

    def errored(self, code: grpc.StatusCode) -> None:
        """A request ended with an error status."""
        self.request_errors.labels(code=status_code_label(code.name)).inc()

    def request(self, n: int, max_tokens: int, prompt_tokens: int) -> RequestTimer:
        """An accepted request starts: count it and time it."""
        self.requests_started.inc()
        self.request_params_n.observe(n)
        self.request_params_max_tokens.observe(max_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        return RequestTimer(self, prompt_tokens)


class RequestTimer:
    """The client-side spans of one request: first token, token intervals per sample, end to end."""

    def __init__(self, metrics: GatewayMetrics, prompt_tokens: int) -> None:
        self._metrics = metrics
        self._prompt_tokens = prompt_tokens
        self.started = time.monotonic()
        self._first_token: float | None = None
        # Per sample: (first token time, last token time, tokens so far).
        self._samples: dict[int, tuple[float, float, int]] = {}

    def tokens_sent(self, index: int, count: int) -> None:
        """Sample `index` sent `count` tokens now."""
        if count <= 0:
            return
        now = time.monotonic()
        metrics = self._metrics
        metrics.generation_tokens.inc(count)
        if self._first_token is None:
            self._first_token = now
            metrics.time_to_first_token.observe(now - self.started)
        seen = self._samples.get(index)
        if seen is None:
            metrics.prompt_tokens.inc(self._prompt_tokens)
            self._samples[index] = (now, now, count)
            return
        first, last, tokens = seen
        metrics.inter_token_latency.observe(now - last)
        self._samples[index] = (first, now, tokens + count)

    def sample_finished(self, index: int, reason: int, usage: generation_pb2.Usage) -> None:
        """Sample `index` ended with finish_reason `reason`."""
        name = sampling_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()  # type: ignore[arg-type]
        metrics = self._metrics
        metrics.request_success.labels(finished_reason=name).inc()
        metrics.request_generation_tokens.observe(usage.completion_tokens)
        seen = self._samples.get(index)
        if seen is not None and seen[2] > 1:
            first, last, tokens = seen
            metrics.time_per_output_token.observe((last - first) / (tokens - 1))

    def finished(self) -> None:
        """Every sample ended: the request's end-to-end latency."""
        self._metrics.e2e_request_latency.observe(time.monotonic() - self.started)
