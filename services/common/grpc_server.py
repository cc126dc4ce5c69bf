"""gRPC server bootstrap: health, reflection, request-id logging, metrics and graceful shutdown."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import REGISTRY, CollectorRegistry

from services.common.internal_auth import InternalTokenInterceptor
from services.common.metrics.exposition import ConstantLabels, Exposition
from services.common.metrics.grpc_metrics import process_grpc_server_metrics
from services.common.metrics.metrics_server import MetricsServer
from services.common.reflection import enable_server_reflection
from services.common.request_context import RequestIdInterceptor
from services.common.rpc_observer import RpcObserver
from services.common.settings import ServiceSettings
from services.common.tls import Security, TLSConfigError, load_security

# Between our own services: token streams are small, but prompts of token ids can be long.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# What the gateway's public port accepts in one message. Anything larger is refused by grpc with
# RESOURCE_EXHAUSTED before it is parsed; 4 MiB (grpc's own default) holds any prompt that can fit
# in a model's context, so a client cannot make the gateway hold 64 MiB per call.
PUBLIC_MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024


# Calls that arrived and wait for the server to take them up. grpc's defaults (1,000, and a hard limit of
# 3,000) cancel the rest of a burst with a bare CANCELLED before any handler runs, so our own admission
# control never sees them (5,000 tiny requests at once got ~35% CANCELLED). Past our own caps callers get
# RESOURCE_EXHAUSTED with RetryInfo instead; a waiting call holds little more than its stream's window.
MAX_PENDING_RPCS = 16_384


def server_options(max_receive_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[tuple[str, int], ...]:
    """gRPC server options; only the receive limit differs between a public and an internal port."""
    return (
        ("grpc.max_receive_message_length", max_receive_message_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # Our channels ping every 20 s even when idle (CHANNEL_OPTIONS); grpc's default server policy
        # accepts pings without calls only every 5 minutes and answers more with GOAWAY "too_many_pings",
        # which an idle channel (the scheduler's to the kvstore, between lookups) then hits within a minute.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.server.max_pending_requests", MAX_PENDING_RPCS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_RPCS),
        # Two services must never share one port by accident.
        ("grpc.so_reuseport", 0),
    )


SERVER_OPTIONS = server_options()
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A restarted peer (a scheduler pod coming back) is found within seconds, not after grpc's
    # default backoff of up to 120 s, during which every call fails fast with UNAVAILABLE.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)

log = structlog.get_logger()


class GrpcService:
    """One service's gRPC server with the standard extras every meshserve service has."""

    def __init__(
        self,
        name: str,
        settings: ServiceSettings,
        service_names: Sequence[str],
        *,
        max_receive_message_bytes: int = MAX_MESSAGE_BYTES,
        interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
        public: bool = False,
        metric_labels: ConstantLabels | None = None,
        metric_registry: CollectorRegistry = REGISTRY,
    ) -> None:
        """`interceptors` None: the standard RequestIdInterceptor (the gateway binds its own ids).

        `public`: the gateway's port, which neither checks the internal token nor (unless
        --tls-client-auth require) asks for client certificates. `metric_labels`: labels every series
        of this process carries (model_name, worker), read at each scrape."""
        self.name = name
        self.settings = settings
        self.service_names = list(service_names)
        self.public = public
        self.security = _load_security_or_exit(name, settings)
        # What /metrics serves, on the metrics port and (gateway) the HTTP front.
        self.exposition = Exposition(
            (REGISTRY, metric_registry), constant_labels=metric_labels, vllm_alias=settings.metrics_vllm_alias
        )
        chain = [RequestIdInterceptor()] if interceptors is None else list(interceptors)
        # Innermost: its access line is written inside the request id's binding.
        chain.append(RpcObserver(process_grpc_server_metrics()))
        if self.security.token is not None and not public:
            # First: a call without the token reaches nothing else.
            chain.insert(0, InternalTokenInterceptor(self.security.token))
        self.server = grpc.aio.server(interceptors=chain, options=server_options(max_receive_message_bytes))
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # grpc.reflection.v1 and v1alpha, each listing both.
        enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], self.server
        )
        self.port = 0
        self.metrics_server: MetricsServer | None = None
        self._stop = asyncio.Event()

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING until set_serving(True)); returns the port."""
        await self.set_serving(False)
        credentials = self.security.server_credentials(public=self.public)
        if credentials is None:
            self.port = self.server.add_insecure_port(self.settings.address)
        else:
            self.port = self.server.add_secure_port(self.settings.address, credentials)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.settings.address}: is the port taken? choose another --port")
        await self.server.start()
        if self.settings.metrics_port:
            try:
                self.metrics_server = MetricsServer(self.exposition, self.settings.host, self.settings.metrics_port)
            except OSError as err:
                raise RuntimeError(
                    f"cannot serve metrics on {self.settings.host}:{self.settings.metrics_port} ({err.strerror}): "
                    "is the port taken? choose another --metrics-port"
                ) from None
            self.metrics_server.start()
        log.info(
            "listening",
            service=self.name,
            address=f"{self.settings.host}:{self.port}",
            metrics_port=self.settings.metrics_port or None,
            tls=self.security.describe(public=self.public),
            internal_token=self.security.token is not None and not self.public,
        )
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Flip grpc.health.v1 status for the server as a whole and each named service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", *self.service_names):
            await self.health.set(service, status)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start a graceful shutdown instead of killing in-flight streams."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        """Ask run_until_stopped to begin draining."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """A stop was requested: health stays NOT_SERVING from now on, whatever else changes."""
        return self._stop.is_set()

    async def run_until_stopped(self, drain: Callable[[float], Awaitable[None]] | None = None) -> None:
        """Serve until a stop is requested, then drain: NOT_SERVING, let streams finish, stop."""
        await self._stop.wait()
        grace = self.settings.shutdown_grace_period
        log.info("draining", service=self.name, grace_period_s=grace)
        await self.set_serving(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if drain is not None:
            try:
                await asyncio.wait_for(drain(grace), timeout=grace)
            except TimeoutError:
                log.warning("drain timed out", service=self.name)
        await self.server.stop(max(0.0, deadline - loop.time()))
        log.info("stopped", service=self.name)


def _load_security_or_exit(name: str, settings: ServiceSettings) -> Security:
    """The service's TLS files and token; a bad flag ends the process with one line that names it."""
    try:
        return load_security(settings)
    except TLSConfigError as err:
        log.error("startup_failed", service=name, error=str(err))
        raise SystemExit(f"meshserve {name}: error: {err}") from None


def run_service(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a service's async main on a fresh event loop."""
    asyncio.run(main())
