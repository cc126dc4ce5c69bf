"""Prometheus metrics of the scheduler: queue, batch, KV blocks and the request phases it owns, under
vLLM's names and buckets (docs/metrics.md).

What a client sees (time to first token, token intervals, end to end, finished requests) is the
gateway's to count; here are the phases only the scheduler sees: queue, prefill, decode. model_name is
added to every series at scrape time (services/common/metrics/exposition.py).
"""

from __future__ import annotations

import contextlib

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import buckets
from services.common.metrics.names import metric
from services.scheduler.request import Request


def _phase(registry: CollectorRegistry, name: str, documentation: str) -> Histogram:
    """A request phase's histogram, with vLLM's request-latency buckets."""
    return Histogram(metric(name), documentation, buckets=buckets.REQUEST_LATENCY, registry=registry)


class SchedulerMetrics:
    """All scheduler metrics, created once per process."""

    def __init__(self, registry: CollectorRegistry = DEFAULT_REGISTRY) -> None:
        self.registry = registry
        self.num_requests_running = Gauge(
            metric("num_requests_running"), "Requests in a running batch, all workers", registry=registry
        )
        self.num_requests_waiting = Gauge(
            metric("num_requests_waiting"), "Requests waiting to be admitted", registry=registry
        )
        self.kv_cache_usage_perc = Gauge(
            metric("kv_cache_usage_perc"),
            "KV blocks in use over all attached workers' blocks (1 means 100 percent)",
            registry=registry,
        )
        self.num_workers = Gauge(metric("num_workers"), "Workers attached and ready", registry=registry)
        self.worker_num_requests_running = Gauge(
            metric("worker_num_requests_running"), "Running requests of one worker", ["worker"], registry=registry
        )
        self.worker_num_requests_waiting = Gauge(
            metric("worker_num_requests_waiting"), "Requests waiting for one worker", ["worker"], registry=registry
        )
        self.worker_kv_cache_usage_perc = Gauge(
            metric("worker_kv_cache_usage_perc"), "One worker's KV block usage", ["worker"], registry=registry
        )
        self.prefix_cache_queries = Counter(
            metric("prefix_cache_queries"), "Prompt tokens looked up in the prefix cache", registry=registry
        )
        self.prefix_cache_hits = Counter(
            metric("prefix_cache_hits"), "Prompt tokens found in the prefix cache", registry=registry
        )
        self.num_preemptions = Counter(metric("num_preemptions"), "Requests preempted", registry=registry)
        self.iteration_tokens = Histogram(
            metric("iteration_tokens_total"),
            "Tokens scheduled per step",
            buckets=buckets.ITERATION_TOKENS,
            registry=registry,
        )
        self.request_queue_time = _phase(
            registry, "request_queue_time_seconds", "Arrival at the scheduler to first scheduled (the WAITING phase)"
        )
        self.request_prefill_time = _phase(
            registry, "request_prefill_time_seconds", "First scheduled to first token (the PREFILL phase)"
        )
        self.request_decode_time = _phase(
            registry, "request_decode_time_seconds", "First token to finish (the DECODE phase)"
        )
        self.request_inference_time = _phase(
            registry, "request_inference_time_seconds", "First scheduled to finish (the RUNNING phase)"
        )
        self.routed = Counter(
            metric("worker_requests_routed"), "Requests the router placed on a worker", ["worker"], registry=registry
        )
        self.worker_prefix_cache_queries = Counter(
            metric("worker_prefix_cache_queries"),
            "Prompt tokens looked up in one worker's prefix cache",
            ["worker"],
            registry=registry,
        )
        self.worker_prefix_cache_hits = Counter(
            metric("worker_prefix_cache_hits"),
            "Prompt tokens found in one worker's prefix cache",
            ["worker"],
            registry=registry,
        )
        self.workers_lost = Counter(
            metric("workers_lost"), "Workers lost (stream broken, heartbeat or step timeout)", ["reason"],
            registry=registry,
        )  # fmt: skip
        self.requests_requeued = Counter(
            metric("requests_requeued"), "Requests moved to another worker after theirs was lost", registry=registry
        )
        self.kv_store_loaded_tokens = Counter(
            metric("kv_store_loaded_tokens"), "Tokens loaded from the kvstore instead of computed", registry=registry
        )
        self.kv_store_load_misses = Counter(
            metric("kv_store_load_misses"), "Blocks a load asked for and did not get (recomputed)", registry=registry
        )
        self.kv_store_lookups = Counter(
            metric("kv_store_lookups"), "kvstore lookups, by outcome (hit, miss, error)", ["outcome"],
            registry=registry,
        )  # fmt: skip

        self.spec_decode_num_drafts = Counter(
            metric("spec_decode_num_drafts"), "Draft proposals sent for verification (one per request and step)",
            registry=registry,
        )  # fmt: skip
        self.spec_decode_num_draft_tokens = Counter(
            metric("spec_decode_num_draft_tokens"), "Draft tokens sent for verification", registry=registry
        )
        self.spec_decode_num_accepted_tokens = Counter(
            metric("spec_decode_num_accepted_tokens"), "Draft tokens the worker's verification kept",
            registry=registry,
        )  # fmt: skip

    def request_phases(self, request: Request, first_token_at: float | None, finished_at: float) -> None:
        """A request finished: the time it spent waiting, in prefill and in decode."""
        scheduled = request.first_scheduled_at
        if scheduled is None:
            return  # aborted before it ever ran
        self.request_queue_time.observe(scheduled - request.arrival_time)
        self.request_inference_time.observe(finished_at - scheduled)
        if first_token_at is not None:
            self.request_prefill_time.observe(first_token_at - scheduled)
            self.request_decode_time.observe(finished_at - first_token_at)

    def forget_worker(self, worker_id: str) -> None:
        """A worker left: its per-worker gauges go (a stale 0 would read as an idle worker)."""
        for gauge in (self.worker_num_requests_running, self.worker_num_requests_waiting,
                      self.worker_kv_cache_usage_perc):  # fmt: skip
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id)


class WorkerMetrics:
    """The planner's events of one worker, counted as they happen (a PlannerListener)."""

    def __init__(self, metrics: SchedulerMetrics, worker_id: str) -> None:
        self._metrics = metrics
        self._queries = metrics.worker_prefix_cache_queries.labels(worker=worker_id)
        self._hits = metrics.worker_prefix_cache_hits.labels(worker=worker_id)

    def preempted(self, request: Request) -> None:
        self._metrics.num_preemptions.inc()

    def kv_loaded(self, num_tokens: int, num_missed_blocks: int) -> None:
        self._metrics.kv_store_loaded_tokens.inc(num_tokens)
        self._metrics.kv_store_load_misses.inc(num_missed_blocks)

    def drafted(self, num_draft_tokens: int) -> None:
        self._metrics.spec_decode_num_drafts.inc()
        self._metrics.spec_decode_num_draft_tokens.inc(num_draft_tokens)

    def drafts_verified(self, num_accepted_tokens: int) -> None:
        self._metrics.spec_decode_num_accepted_tokens.inc(num_accepted_tokens)

    def prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self._metrics.prefix_cache_queries.inc(num_tokens)
        self._metrics.prefix_cache_hits.inc(num_hit_tokens)
        self._queries.inc(num_tokens)
        self._hits.inc(num_hit_tokens)
