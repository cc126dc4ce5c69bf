"""Prometheus metrics of the worker: its steps, its batch, its KV blocks and its ranks' memory (docs/metrics.md).

Recorded on the model thread right after each step (a few counter and histogram updates, well under a
microsecond each); model_name and worker are added to every series at scrape time. Torch-free: the
numbers come from the runner through StepExecutor and BatchState.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import buckets
from services.common.metrics.names import metric
from services.common.proto.meshserve.v1 import worker_pb2
from services.worker.attach import PipelinedExecutor, StepExecutor

# Tokens computed in one step: vLLM's iteration-token buckets.
_STEP_TOKENS = buckets.ITERATION_TOKENS


class BatchState(Protocol):
    """What the metrics read off the runner after a step."""

    @property
    def num_requests(self) -> int: ...

    @property
    def num_blocks_held(self) -> int: ...


class RankMemoryReport(Protocol):
    """One rank's memory after loading (services/worker/model_runner.py RankMemory)."""

    @property
    def rank(self) -> int: ...

    @property
    def weights_bytes(self) -> int: ...

    @property
    def kv_cache_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...


class WorkerMetrics:
    """All worker metrics, created once per process."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.steps = Counter(metric("worker_steps"), "Steps executed", registry=registry)
        self.step_duration = Histogram(
            metric("worker_step_duration_seconds"),
            "Execute time of one step on rank 0 (forward and sampling)",
            buckets=buckets.STEP_SECONDS,
            registry=registry,
        )
        self.batch_size = Histogram(
            metric("worker_batch_size"), "Requests in one step", buckets=buckets.BATCH_SIZE, registry=registry
        )
        self.step_tokens = Histogram(
            metric("worker_step_tokens"), "Tokens computed in one step", buckets=_STEP_TOKENS, registry=registry
        )
        self.num_requests_running = Gauge(
            metric("worker_batch_requests"), "Requests in the worker's persistent batch", registry=registry
        )
        self.kv_blocks_used = Gauge(
            metric("worker_kv_blocks_used"), "KV blocks the batch's requests hold", registry=registry
        )
        self.kv_blocks_total = Gauge(metric("worker_kv_blocks_total"), "KV blocks of the cache", registry=registry)
        self.device_memory = Gauge(
            metric("worker_device_memory_bytes"),
            "Device memory of one tensor-parallel rank after loading, by kind (weights, kv_cache, used)",
            ["rank", "kind"],
            registry=registry,
        )

    def loaded(self, num_blocks: int, ranks: Sequence[RankMemoryReport], device_type: str) -> None:
        """The model and its KV cache are in place on every rank."""
        self.kv_blocks_total.set(num_blocks)
        for rank in ranks:
            label = str(rank.rank)
            self.device_memory.labels(label, "weights").set(rank.weights_bytes)
            self.device_memory.labels(label, "kv_cache").set(rank.kv_cache_bytes)
            if device_type != "cpu":
                # On the CPU "used" would be the whole host's RAM, not this worker's.
                self.device_memory.labels(label, "used").set(rank.used_bytes)

    def batch_changed(self, batch: BatchState) -> None:
        """The persistent batch after a step (or a reset)."""
        self.num_requests_running.set(batch.num_requests)
        self.kv_blocks_used.set(batch.num_blocks_held)


class MeteredExecutor:
    """A StepExecutor that records every step it runs."""

    def __init__(self, inner: StepExecutor, metrics: WorkerMetrics, batch: BatchState) -> None:
        self._inner = inner
        self._metrics = metrics
        self._batch = batch

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        """Run the step on the inner executor, then count it."""
        started = time.perf_counter()
        result = self._inner.execute(step)
        self._count(step, result, started)
        return result

    def _count(self, step: worker_pb2.Step, result: worker_pb2.StepResult, started: float) -> None:
        elapsed = result.execute_seconds or (time.perf_counter() - started)
        metrics = self._metrics
        metrics.steps.inc()
        metrics.step_duration.observe(elapsed)
        work = len(step.new_requests) + len(step.scheduled)
        if work:
            metrics.batch_size.observe(work)
            tokens = sum(r.num_scheduled_tokens for r in step.new_requests)
            tokens += sum(r.num_scheduled_tokens for r in step.scheduled)
            metrics.step_tokens.observe(tokens)
        metrics.batch_changed(self._batch)

    def reset(self) -> None:
        """Empty the inner executor's batch."""
        self._inner.reset()
        self._metrics.batch_changed(self._batch)


class MeteredPipelinedExecutor(MeteredExecutor):
    """A PipelinedExecutor that records every step once it is answered."""

    def __init__(self, inner: PipelinedExecutor, metrics: WorkerMetrics, batch: BatchState) -> None:
        super().__init__(inner, metrics, batch)
        self._pipelined = inner

    def launch(self, step: worker_pb2.Step) -> Future[worker_pb2.StepResult]:
        """Start the step on the inner executor; count it when its answer arrives."""
        started = time.perf_counter()
        future = self._pipelined.launch(step)

        def count(done: Future[worker_pb2.StepResult]) -> None:
            if done.exception() is None:
                self._count(step, done.result(), started)

        future.add_done_callback(count)
        return future
