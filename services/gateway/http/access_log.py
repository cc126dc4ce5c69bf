"""One access line per HTTP request, as rpc_observer writes one per RPC: method, path, peer, status,
duration, and what the pipeline added (request id, tokens). /health and /metrics log at debug: probes
and scrapes every few seconds would drown the lines that matter."""

from __future__ import annotations

import time

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.rpc_observer import start_call_record

log = structlog.get_logger()
_QUIET_PATHS = frozenset({"/health", "/metrics"})


class AccessLog:
    """ASGI middleware around the OpenAI front."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = start_call_record()
        started = time.monotonic()
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope.get("path", "")
            client = scope.get("client")
            emit = log.debug if path in _QUIET_PATHS else log.info
            emit(
                "http",
                method=scope.get("method", ""),
                path=path,
                peer=f"{client[0]}:{client[1]}" if client else "",
                # 0: the connection ended before a response started (the client left).
                status=status,
                duration_ms=round((time.monotonic() - started) * 1000, 3),
                **record.fields,
            )
