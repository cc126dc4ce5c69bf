"""The schedulers a gateway submits to: one shared stream each, their health and limits from GetModelInfo."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.channels import open_channel
from services.common.proto.meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.settings import ServiceSettings
from services.common.tls import Security
from services.gateway.routing import Candidate, choose, prefix_key
from services.gateway.scheduler_stream import SchedulerStream

log = structlog.get_logger()


@dataclass(frozen=True)
class ModelLimits:
    """What a request must respect, as the healthy schedulers' workers report it."""

    max_model_len: int
    vocab_size: int
    # The name the workers serve under (their directory or served name); empty when unknown.
    model_name: str = ""


def is_healthy(info: scheduler_pb2.ModelInfo | None) -> bool:
    """A scheduler takes requests now: it answered, accepts, has a ready worker and knows its limits."""
    return (
        info is not None
        and info.accepting
        and info.num_ready_workers > 0
        and info.max_model_len > 0
        and info.vocab_size > 0
    )


@dataclass
class SchedulerBackend:
    """One scheduler: its channel, its shared stream and its latest GetModelInfo (None: no answer)."""

    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    stream: SchedulerStream
    info: scheduler_pb2.ModelInfo | None = None
    poller: asyncio.Task[None] | None = field(default=None, repr=False)
    # What was last logged about it ("" when ready), so the log says when it changes, not every poll.
    reported: str | None = None

    @property
    def healthy(self) -> bool:
        return is_healthy(self.info)

    @property
    def load(self) -> int:
        """Its requests as of the last poll, plus this gateway's in flight on it (which the poll may lag)."""
        return (self.info.num_requests if self.info is not None else 0) + self.stream.in_flight


class SchedulerPool:
    """Polls every scheduler, reports the gateway's health, and picks a scheduler per request."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        max_buffered_tokens: int,
        poll_interval: float,
        poll_timeout: float,
        load_slack: int,
        on_health_change: Callable[[bool], Awaitable[None]],
        security: Security | ServiceSettings | None = None,
    ) -> None:
        """`security`: TLS and internal token of the channels (the gateway's settings; None: insecure)."""
        if not addresses:
            raise ValueError("a gateway needs at least one scheduler address")
        self._addresses = list(addresses)
        self._max_buffered_tokens = max_buffered_tokens
        self._poll_interval = poll_interval
        self._poll_timeout = poll_timeout
        self._load_slack = load_slack
        self._on_health_change = on_health_change
        self._security = security
        self.backends: list[SchedulerBackend] = []
        self._healthy = False

    async def start(self) -> None:
        """Open a channel to each scheduler and start polling it."""
        for address in self._addresses:
            channel = open_channel(address, self._security)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            backend = SchedulerBackend(address, channel, stub, SchedulerStream(stub, self._max_buffered_tokens))
            backend.poller = asyncio.create_task(self._poll(backend))
            self.backends.append(backend)

    async def close(self) -> None:
        """Stop polling, end every stream (their requests fail with UNAVAILABLE) and close the channels."""
        for backend in self.backends:
            if backend.poller is not None:
                backend.poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await backend.poller
            await backend.stream.close()
            await backend.channel.close()
        self.backends.clear()

    @property
    def healthy(self) -> bool:
        """Whether any scheduler takes requests now."""
        return any(b.healthy for b in self.backends)

    def limits(self) -> ModelLimits | None:
        """The strictest limits among the healthy schedulers (a request that fits goes anywhere); None: none."""
        infos = [b.info for b in self.backends if b.healthy and b.info is not None]
        if not infos:
            return None
        return ModelLimits(min(i.max_model_len for i in infos), min(i.vocab_size for i in infos), infos[0].model_name)

    def pick(self, prompt_token_ids: Sequence[int]) -> SchedulerBackend | None:
        """The scheduler for a new request with this prompt (see routing.choose); None when none is healthy."""
        healthy = [b for b in self.backends if b.healthy]
        index = choose([Candidate(b.address, b.load) for b in healthy], prefix_key(prompt_token_ids), self._load_slack)
        return None if index is None else healthy[index]

    async def _poll(self, backend: SchedulerBackend) -> None:
        while True:
            try:
                info: scheduler_pb2.ModelInfo | None = await backend.stub.GetModelInfo(
                    scheduler_pb2.GetModelInfoRequest(), timeout=self._poll_timeout
                )
                problem = "" if is_healthy(info) else _why_unhealthy(info)
            except grpc.aio.AioRpcError as err:
                info, problem = None, f"{err.code().name}: {err.details()}"
            backend.info = info
            if problem != backend.reported:
                backend.reported = problem
                self._log_change(backend, problem)
            await self._publish()
            await asyncio.sleep(self._poll_interval)

    def _log_change(self, backend: SchedulerBackend, problem: str) -> None:
        info = backend.info
        if backend.healthy and info is not None:
            log.info(
                "scheduler ready",
                scheduler=backend.address,
                model=info.model_name,
                model_identity=info.model_identity,
                max_model_len=info.max_model_len,
                vocab_size=info.vocab_size,
                ready_workers=info.num_ready_workers,
            )
            identities = {b.info.model_identity for b in self.backends if b.healthy and b.info is not None}
            if len(identities) > 1:
                log.warning("schedulers serve different models", model_identities=sorted(identities))
        else:
            log.warning("scheduler not ready", scheduler=backend.address, reason=problem)

    async def _publish(self) -> None:
        healthy = self.healthy
        if healthy != self._healthy:
            self._healthy = healthy
            try:
                await self._on_health_change(healthy)
            except Exception:
                # A poller that died here would freeze the gateway's health; the next poll tries again.
                log.exception("health update failed", healthy=healthy)
                self._healthy = not healthy


def _why_unhealthy(info: scheduler_pb2.ModelInfo | None) -> str:
    if info is None:
        return "no answer"
    if not info.accepting:
        return "draining"
    if info.num_ready_workers == 0:
        return "no ready worker"
    return "limits unknown"
