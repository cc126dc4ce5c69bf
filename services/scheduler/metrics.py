"""Prometheus metrics of the scheduler, under vLLM-compatible names."""

from __future__ import annotations

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.request import Request

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class SchedulerMetrics:
    """All scheduler metrics, created once per process."""

    def __init__(self, registry: CollectorRegistry = DEFAULT_REGISTRY) -> None:
        self.num_requests_running = Gauge(
            "meshserve:num_requests_running", "Requests in a worker's running batch", registry=registry
        )
        self.num_requests_waiting = Gauge(
            "meshserve:num_requests_waiting", "Requests waiting to be admitted", registry=registry
        )
        self.kv_cache_usage_perc = Gauge(
            "meshserve:kv_cache_usage_perc",
            "Fraction of KV blocks in use, per worker",
            ["worker"],
            registry=registry,
        )
        self.num_workers = Gauge("meshserve:num_workers", "Attached workers", registry=registry)
        self.prefix_cache_queries = Counter(
            "meshserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=registry
        )
        self.prefix_cache_hits = Counter(
            "meshserve:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=registry
        )
        self.num_preemptions = Counter(
            "meshserve:num_preemptions", "Requests preempted for recompute", registry=registry
        )
        self.request_success = Counter(
            "meshserve:request_success", "Finished requests", ["finished_reason"], registry=registry
        )
        self.iteration_tokens = Histogram(
            "meshserve:iteration_tokens_total",
            "Tokens scheduled per step",
            buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "meshserve:time_to_first_token_seconds",
            "Arrival at the scheduler to first token",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "meshserve:e2e_request_latency_seconds",
            "Arrival at the scheduler to finish",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.routed = Counter(
            "meshserve:worker_requests_routed", "Requests the router placed on a worker", ["worker"], registry=registry
        )
        self.worker_prefix_cache_queries = Counter(
            "meshserve:worker_prefix_cache_queries",
            "Prompt tokens looked up in one worker's prefix cache",
            ["worker"],
            registry=registry,
        )
        self.worker_prefix_cache_hits = Counter(
            "meshserve:worker_prefix_cache_hits",
            "Prompt tokens found in one worker's prefix cache",
            ["worker"],
            registry=registry,
        )
        self.workers_lost = Counter(
            "meshserve:workers_lost", "Workers lost (stream broken, heartbeat or step timeout)", ["reason"],
            registry=registry,
        )  # fmt: skip
        self.requests_requeued = Counter(
            "meshserve:requests_requeued", "Requests moved to another worker after theirs was lost", registry=registry
        )
        self.kv_store_loaded_tokens = Counter(
            "meshserve:kv_store_loaded_tokens", "Tokens loaded from the kvstore instead of computed", registry=registry
        )
        self.kv_store_load_misses = Counter(
            "meshserve:kv_store_load_misses", "Blocks a load asked for and did not get (recomputed)", registry=registry
        )
        self.kv_store_lookups = Counter(
            "meshserve:kv_store_lookups", "kvstore lookups, by outcome (hit, miss, error)", ["outcome"],
            registry=registry,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "meshserve:step_duration_seconds",
            "Worker execute time of one step",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )


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

    def prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self._metrics.prefix_cache_queries.inc(num_tokens)
        self._metrics.prefix_cache_hits.inc(num_hit_tokens)
        self._queries.inc(num_tokens)
        self._hits.inc(num_hit_tokens)
