"""`meshserve gateway`: the public Generation API in front of one or more schedulers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from services.common.grpc_server import PUBLIC_MAX_RECEIVE_MESSAGE_BYTES, GrpcService
from services.common.logs import configure_logging
from services.common.metrics.names import MODEL_NAME_LABEL
from services.common.model_paths import resolve_model_path
from services.common.sampling_checks import InvalidField, check_eos_token_ids
from services.common.tracing import setup_tracing
from services.gateway.admission import Admission
from services.gateway.api_keys import ApiKeys, read_key_file
from services.gateway.http.app import create_app
from services.gateway.http.http_server import HttpServer
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import GenerationPipeline
from services.gateway.rate_limit import RateLimits, make_rate_limiter
from services.gateway.sampling_defaults import SamplingDefaults, load_sampling_defaults
from services.gateway.scheduler_pool import SchedulerPool
from services.gateway.servicer import SERVICE_NAME, GenerationServicer
from services.gateway.settings import GatewaySettings
from services.gateway.tokenizer import TextTokenizer

log = structlog.get_logger()


def load_api_keys(settings: GatewaySettings) -> ApiKeys:
    """--api-key values plus the keys of --api-key-file (a missing file is a startup error naming it)."""
    keys = list(settings.api_key)
    if settings.api_key_file:
        try:
            keys += read_key_file(Path(settings.api_key_file))
        except OSError as err:
            raise ValueError(f"--api-key-file {settings.api_key_file}: {err.strerror or err}") from err
    return ApiKeys(keys)


class Gateway:
    """The gateway's parts wired together: the public server, the scheduler pool, admission, tokenizer threads.

    Health is SERVING only while some scheduler answers GetModelInfo with a ready worker, and never
    again once a stop was requested.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: TextTokenizer,
        metrics: GatewayMetrics | None = None,
        defaults: SamplingDefaults | None = None,
    ):
        try:
            check_eos_token_ids(tokenizer.eos_token_ids)
        except InvalidField as err:
            raise ValueError(f"the model's tokenizer configuration lists too many eos ids: {err}") from err
        self.settings = settings
        metrics = metrics or GatewayMetrics()
        # The gateway binds its own request ids (request_ids.py), so no RequestIdInterceptor here.
        self.service = GrpcService(
            "gateway",
            settings,
            [SERVICE_NAME],
            max_receive_message_bytes=PUBLIC_MAX_RECEIVE_MESSAGE_BYTES,
            interceptors=(),
            public=True,
            metric_labels=self._metric_labels,
            metric_registry=metrics.registry,
        )
        self.pool = SchedulerPool(
            settings.scheduler_addresses,
            max_buffered_tokens=settings.stream_buffer_tokens,
            poll_interval=settings.scheduler_poll_interval,
            poll_timeout=settings.scheduler_poll_timeout,
            load_slack=settings.routing_load_slack,
            on_health_change=self._on_health_change,
            security=self.service.security,
        )
        admission = Admission(
            settings.max_concurrent_requests, settings.max_concurrent_requests_per_client, settings.retry_after
        )
        self._executor = ThreadPoolExecutor(settings.tokenizer_threads, thread_name_prefix="tokenize")
        limits = RateLimits(settings.rate_limit_requests_per_minute, settings.rate_limit_tokens_per_minute)
        self.rate_limiter = make_rate_limiter(limits, settings.redis)
        # --otlp-endpoint: each request's generate span goes to the collector (without: nothing is installed).
        self.tracing = setup_tracing("gateway", settings.otlp_endpoint)
        self.pipeline = GenerationPipeline(
            tokenizer,
            self.pool,
            admission,
            self._executor,
            metrics,
            defaults=defaults,
            served_model_names=settings.served_model_name,
            api_keys=load_api_keys(settings),
            rate_limiter=self.rate_limiter,
            tracing=self.tracing,
        )
        self.servicer = GenerationServicer(self.pipeline, write_timeout=settings.stream_write_timeout)
        self.service.server.add_generic_rpc_handlers((self.servicer.handlers(),))
        # The OpenAI-compatible HTTP front, over the same pipeline (--http-port; -1: off).
        self.http: HttpServer | None = None
        if settings.http_port >= 0:
            app = create_app(
                self.pipeline,
                self._executor,
                write_timeout=settings.stream_write_timeout,
                exposition=self.service.exposition,
            )
            self.http = HttpServer(
                app,
                settings.host,
                settings.http_port,
                tls_cert=settings.tls_cert,
                tls_key=settings.tls_key,
                # Room for every admitted request, as many again (and some) to be refused with a clean 429.
                max_connections=2 * settings.max_concurrent_requests + 128,
            )

    def _metric_labels(self) -> dict[str, str]:
        # The name clients use: --served-model-name, else what the workers report (known once one attaches).
        names = self.pipeline.model_names()
        return {MODEL_NAME_LABEL: names[0] if names else ""}

    async def _on_health_change(self, healthy: bool) -> None:
        if self.service.stopping:
            return  # draining: health stays NOT_SERVING
        await self.service.set_serving(healthy)
        log.info("serving" if healthy else "not serving: no scheduler with a ready worker")

    @property
    def address(self) -> str:
        """host:port of the public listener, once started."""
        return f"{self.settings.host}:{self.service.port}"

    @property
    def http_port(self) -> int | None:
        """The HTTP front's bound port, once started; None when it is off."""
        return self.http.port if self.http is not None and self.http.port else None

    async def start(self) -> int:
        """Listen (NOT_SERVING until a scheduler is ready) and start polling; returns the gRPC port."""
        port = await self.service.start()
        await self.pool.start()
        if self.http is not None:
            await self.http.start()
        return port

    async def run_until_stopped(self) -> None:
        """Serve until request_stop() (or a signal), drain, then close everything."""
        try:
            await self.service.run_until_stopped(self.pipeline.drain)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop the HTTP front, end the scheduler streams and tokenizer threads (after the server stopped), and
        export the spans still queued."""
        if self.http is not None:
            await self.http.stop()
        await self.pool.close()
        if self.rate_limiter is not None:
            await self.rate_limiter.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        await self.tracing.shutdown()


async def serve(settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT, then let in-flight streams finish within the grace period."""
    configure_logging("gateway", settings.log_level, settings.log_format)
    model_dir = resolve_model_path(settings.model)
    defaults = load_sampling_defaults(model_dir, settings.generation_config)
    gateway = Gateway(settings, TextTokenizer.from_dir(model_dir), defaults=defaults)
    gateway.service.install_signal_handlers()
    await gateway.start()
    log.info(
        "gateway started",
        model=str(model_dir),
        schedulers=settings.scheduler_addresses,
        sampling_defaults=defaults.source,
        http_port=gateway.http_port,
    )
    await gateway.run_until_stopped()
