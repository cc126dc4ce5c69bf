"""Prometheus metrics of the gateway: what clients see, under vLLM-compatible names."""

from __future__ import annotations

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """All gateway metrics, created once per process."""

    def __init__(self, registry: CollectorRegistry = DEFAULT_REGISTRY) -> None:
        # Where these live, for whatever exposes them (the HTTP front's /metrics).
        self.registry = registry
        self.requests_started = Counter("meshserve:requests_started", "Accepted requests", registry=registry)
        self.requests_rejected = Counter(
            "meshserve:requests_rejected", "Requests refused as invalid", registry=registry
        )
        self.requests_refused = Counter(
            "meshserve:requests_refused",
            "Requests refused before they started (over a concurrency cap, no scheduler ready, draining)",
            ["reason"],
            registry=registry,
        )
        self.requests_cancelled = Counter(
            "meshserve:requests_cancelled", "Requests whose client left or that failed", registry=registry
        )
        self.request_success = Counter(
            "meshserve:request_success", "Finished requests", ["finished_reason"], registry=registry
        )
        self.prompt_tokens = Counter("meshserve:prompt_tokens", "Prompt tokens", registry=registry)
        self.generation_tokens = Counter("meshserve:generation_tokens", "Generated tokens", registry=registry)
        self.time_to_first_token = Histogram(
            "meshserve:time_to_first_token_seconds",
            "Request arrival at the gateway to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "meshserve:e2e_request_latency_seconds",
            "Request arrival at the gateway to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    def observe_finish(self, reason: int, usage: generation_pb2.Usage) -> None:
        """Count one finished request and its tokens."""
        name = sampling_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()  # type: ignore[arg-type]
        self.request_success.labels(finished_reason=name).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
