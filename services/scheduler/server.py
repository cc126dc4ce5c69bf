"""`meshserve scheduler`: run the Scheduler service until SIGTERM."""

from __future__ import annotations

import structlog

from services.common.grpc_server import GrpcService
from services.common.logs import configure_logging
from services.common.metrics.names import MODEL_NAME_LABEL
from services.common.proto.meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.tracing import setup_tracing
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.settings import SchedulerSettings

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


async def serve(settings: SchedulerSettings) -> None:
    """Serve until SIGTERM/SIGINT, then drain: running requests finish, workers are released."""
    configure_logging("scheduler", settings.log_level, settings.log_format)
    servicer: SchedulerServicer | None = None

    def metric_labels() -> dict[str, str]:
        # The name the workers report (their --served-model-name), known once the first attaches.
        return {MODEL_NAME_LABEL: servicer.cluster.model_name if servicer is not None else ""}

    service = GrpcService("scheduler", settings, [SERVICE_NAME], metric_labels=metric_labels)
    # --otlp-endpoint: each request's queue, prefill and decode spans go to the collector.
    tracing = setup_tracing("scheduler", settings.otlp_endpoint)
    servicer = SchedulerServicer(settings, SchedulerMetrics(), on_ready_change=service.set_serving, tracing=tracing)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, service.server)
    service.install_signal_handlers()
    await service.start()
    structlog.get_logger().info(
        "scheduler ready for workers",
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        prefix_caching=settings.enable_prefix_caching,
    )
    try:
        await service.run_until_stopped(servicer.drain)
    finally:
        # The spans of the requests that finished while draining are still queued in the exporter.
        await tracing.shutdown()
