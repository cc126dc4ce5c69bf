"""docs/metrics.md names exactly what the services export, and every vLLM alias is a vLLM name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.common.metrics.grpc_metrics import GrpcServerMetrics
from services.common.metrics.names import PREFIX, VLLM_COUNTERPARTS
from services.gateway.metrics import GatewayMetrics
from services.kvstore.metrics import KVStoreMetrics
from services.scheduler.metrics import SchedulerMetrics
from services.worker.metrics import WorkerMetrics
from services.worker.telemetry.device_telemetry import DeviceTelemetry
from tests.support.metric_catalogue import documented_metrics


def _exported(registry: CollectorRegistry) -> dict[str, str]:
    """Name as a query writes it (counters with _total) -> type, for every family, with or without samples."""
    out = {}
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = family.type
    return out


def _every_service() -> dict[str, dict[str, str]]:
    built: dict[str, dict[str, str]] = {}
    for service, make in (
        ("gateway", GatewayMetrics),
        ("scheduler", SchedulerMetrics),
        ("worker", WorkerMetrics),
        ("kvstore", KVStoreMetrics),
        ("grpc", GrpcServerMetrics),
    ):
        registry = CollectorRegistry()
        make(registry)
        if service == "worker":
            DeviceTelemetry(registry, "npu", model_name="m", worker="w", reader=lambda: [])
        built[service] = _exported(registry)
    return built


def test_the_docs_name_exactly_what_the_services_export() -> None:
    exported = {name: kind for names in _every_service().values() for name, kind in names.items()}
    documented = {m.name: m.type for m in documented_metrics()}
    assert sorted(set(exported) - set(documented)) == [], "exported but not in docs/metrics.md"
    assert sorted(set(documented) - set(exported)) == [], "in docs/metrics.md but not exported"
    assert {n: k for n, k in exported.items() if documented[n] != k} == {}, "types differ"


def test_the_vllm_marks_are_our_vllm_counterparts() -> None:
    # A counter's family name has no _total (iteration_tokens_total is a histogram named so by vLLM).
    marked = {
        m.name.removeprefix(PREFIX).removesuffix("_total") if m.type == "counter" else m.name.removeprefix(PREFIX)
        for m in documented_metrics()
        if m.vllm_alias
    }
    assert marked == set(VLLM_COUNTERPARTS)
