"""`meshserve gateway`: the public Generation API in front of the scheduler."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from services.common.channels import insecure_channel
from services.common.grpc_server import GrpcService
from services.common.logs import configure_logging
from services.common.model_paths import resolve_model_path
from services.common.proto.meshserve.v1 import scheduler_pb2_grpc
from services.gateway.metrics import GatewayMetrics
from services.gateway.scheduler_stream import SchedulerStream
from services.gateway.servicer import SERVICE_NAME, GenerationServicer
from services.gateway.settings import GatewaySettings
from services.gateway.tokenizer import TextTokenizer
from services.gateway.validation import Limits

log = structlog.get_logger()


async def serve(settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT, then let in-flight streams finish within the grace period."""
    configure_logging("gateway", settings.log_level, settings.log_format)
    model_dir = resolve_model_path(settings.model)
    tokenizer = TextTokenizer.from_dir(model_dir)
    max_model_len = settings.max_model_len or tokenizer.max_position_embeddings
    if max_model_len is None:
        raise ValueError("the model config has no max_position_embeddings; pass --max-model-len")
    limits = Limits(max_model_len=max_model_len, vocab_size=tokenizer.vocab_size)
    service = GrpcService("gateway", settings, [SERVICE_NAME])
    async with insecure_channel(settings.scheduler_address) as channel:
        scheduler = SchedulerStream(scheduler_pb2_grpc.SchedulerStub(channel))
        servicer = GenerationServicer(tokenizer, scheduler, limits, GatewayMetrics())
        service.server.add_generic_rpc_handlers((servicer.handlers(),))
        service.install_signal_handlers()
        await service.start()
        await _wait_for_scheduler(channel, settings.scheduler_address)
        await service.set_serving(True)
        log.info("gateway ready", model=str(model_dir), max_model_len=max_model_len)
        try:
            await service.run_until_stopped(servicer.drain)
        finally:
            await scheduler.close()


async def _wait_for_scheduler(channel: grpc.aio.Channel, address: str) -> None:
    """Block until the scheduler's port answers, logging while it does not."""
    while True:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=5.0)
            return
        except TimeoutError:
            log.warning("scheduler not reachable yet", scheduler=address)
