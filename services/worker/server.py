"""`meshserve worker`: load the model, serve health, attach to the scheduler, execute steps."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import structlog

from services.common.grpc_server import GrpcService
from services.common.logs import configure_logging
from services.common.model_paths import resolve_model_path
from services.common.proto.meshserve.v1 import worker_pb2
from services.worker.attach import AttachClient
from services.worker.engine_config import EngineConfig
from services.worker.settings import WorkerSettings

log = structlog.get_logger()
# The worker serves only grpc.health.v1 (and reflection); its work arrives over Attach.
HEALTH_ONLY: list[str] = []


def engine_config(settings: WorkerSettings) -> EngineConfig:
    """The model runner's config from the worker's settings."""
    return EngineConfig(
        model_path=str(resolve_model_path(settings.model)),
        dtype=settings.dtype,
        device="cpu" if settings.device == "auto" else settings.device,
        block_size=settings.block_size,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        seed=settings.seed,
    )


async def serve(settings: WorkerSettings) -> None:
    """Load, attach, and serve steps until SIGTERM; then drain and detach."""
    configure_logging("worker", settings.log_level, settings.log_format)
    service = GrpcService("worker", settings, HEALTH_ONLY)
    service.install_signal_handlers()
    await service.start()
    config = engine_config(settings)
    # Imported here: torch loads only in the process that runs the model.
    from services.worker.model_runner import ModelRunner

    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    runner = await asyncio.get_running_loop().run_in_executor(model_thread, ModelRunner, config)
    worker_id = settings.worker_id or f"{socket.gethostname()}:{os.getpid()}:{service.port}"
    hello = worker_pb2.WorkerHello(
        worker_id=worker_id,
        device=runner.device_type,
        tensor_parallel_size=1,
        model_fingerprint=runner.fingerprint,
        model_name=runner.model_name,
        block_size=runner.block_size,
        num_blocks=runner.num_blocks,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        health_address=f"{settings.host}:{service.port}",
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
    )
    log.info("model loaded", model=runner.model_name, num_blocks=runner.num_blocks, worker_id=worker_id)
    client = AttachClient(
        settings.scheduler_address, hello, runner, service.set_serving, model_thread, settings.reconnect_interval
    )
    attach_task = asyncio.create_task(client.run())

    async def drain(grace: float) -> None:
        client.drain("SIGTERM")
        try:
            await asyncio.wait_for(asyncio.shield(attach_task), timeout=max(0.0, grace - 1.0))
        except TimeoutError:
            client.close()

    await service.run_until_stopped(drain)
    client.close()
    attach_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await attach_task
    model_thread.shutdown(wait=True)
