"""`meshserve kvstore`: serve the KV-block store until SIGTERM."""

from __future__ import annotations

import structlog

from services.common.grpc_server import GrpcService
from services.common.logs import configure_logging
from services.common.proto.meshserve.v1 import kvstore_pb2_grpc
from services.kvstore.backend import Backend
from services.kvstore.health import BACKEND_HEALTH_NAME, SERVICE_NAME
from services.kvstore.memory_backend import MemoryBackend
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.redis_backend import RedisBackend
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.settings import MAX_RECEIVE_MESSAGE_BYTES, KVStoreSettings

__all__ = ["BACKEND_HEALTH_NAME", "SERVICE_NAME", "serve"]


def make_backend(settings: KVStoreSettings, metrics: KVStoreMetrics) -> Backend:
    """The backend --backend names."""
    if settings.backend_kind == "memory":
        return MemoryBackend(settings.capacity_bytes, on_evict=metrics.evicted, reserve=settings.reserve_memory)
    return RedisBackend(
        settings.backend,
        max_connections=settings.redis_max_connections,
        timeout_s=settings.redis_timeout,
        ttl_seconds=settings.ttl_seconds,
    )


async def serve(settings: KVStoreSettings) -> None:
    """Serve until SIGTERM/SIGINT, then drain: calls in flight finish, then the backend is released."""
    configure_logging("kvstore", settings.log_level, settings.log_format)
    metrics = KVStoreMetrics()
    service = GrpcService("kvstore", settings, [SERVICE_NAME], max_receive_message_bytes=MAX_RECEIVE_MESSAGE_BYTES)
    servicer = KVStoreServicer(settings, make_backend(settings, metrics), service.health, metrics)
    kvstore_pb2_grpc.add_KVBlockStoreServicer_to_server(servicer, service.server)
    service.install_signal_handlers()
    await service.start()
    await servicer.start()
    # SERVING whether or not the backend answers: the store answers misses without one.
    await service.set_serving(True)
    structlog.get_logger().info(
        "kvstore ready",
        backend=servicer.store.backend.name,
        backend_serving=servicer.store.serving,
        capacity_bytes=settings.capacity_bytes if settings.backend_kind == "memory" else None,
        ttl_seconds=settings.ttl_seconds or None,
    )
    try:
        await service.run_until_stopped()
    finally:
        await servicer.close()
