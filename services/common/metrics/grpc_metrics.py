"""gRPC server metrics under go-grpc-prometheus' names, which gRPC dashboards and alerts already use."""

from __future__ import annotations

import functools

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from services.common.metrics.buckets import GRPC_HANDLING

_CALL = ["grpc_service", "grpc_method", "grpc_type"]


class GrpcServerMetrics:
    """Started, handled (by code), handling time and messages of every RPC a server takes."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.started = Counter("grpc_server_started", "RPCs started on the server", _CALL, registry=registry)
        self.handled = Counter(
            "grpc_server_handled", "RPCs completed on the server, by status code", [*_CALL, "grpc_code"],
            registry=registry,
        )  # fmt: skip
        self.handling_seconds = Histogram(
            "grpc_server_handling_seconds", "Time from an RPC's start to its status", _CALL,
            buckets=GRPC_HANDLING, registry=registry,
        )  # fmt: skip
        self.msg_received = Counter(
            "grpc_server_msg_received", "Stream messages received from clients", _CALL, registry=registry
        )
        self.msg_sent = Counter("grpc_server_msg_sent", "Stream messages sent to clients", _CALL, registry=registry)


@functools.cache
def process_grpc_server_metrics() -> GrpcServerMetrics:
    """The process's one set, in the default registry (a process may build more than one server)."""
    return GrpcServerMetrics()
