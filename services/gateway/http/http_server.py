"""uvicorn in the gateway's own event loop: bound before start returns, stopped by the gateway, no signals.

The socket is bound here (port 0: any free one), so a taken port fails the gateway's start with a clear
message and `port` is the real one. uvicorn's own signal capture is disabled: SIGTERM and SIGINT belong
to the gateway, which drains both fronts and then stops this server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import structlog
import uvicorn
from starlette.types import ASGIApp

from services.gateway.http.access_log import AccessLog

log = structlog.get_logger()
# After the gateway drained, how long connections still open may take to finish before they are cut.
SHUTDOWN_TIMEOUT_S = 1


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gateway owns SIGTERM and SIGINT


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise RuntimeError(f"cannot listen on {host}:{port} (HTTP): {err}") from err
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise RuntimeError(
            f"cannot listen on {host}:{port} (HTTP): {err.strerror or err}; is the port taken? choose another "
            "--http-port"
        ) from err
    sock.setblocking(False)
    return sock


class HttpServer:
    """One uvicorn server for `app` on host:port, run as a task of the current loop."""

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        *,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        max_connections: int | None = None,
    ) -> None:
        # Past max_connections open connections uvicorn answers 503 at once, so a connection flood costs a
        # bounded number of tasks and buffers.
        self._max_connections = max_connections
        # With the gateway's --tls-cert/--tls-key the HTTP front serves HTTPS too: a plaintext port beside a
        # TLS gRPC port would undo the TLS.
        self._tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if tls_cert and tls_key else {}
        self._app = app
        self._host = host
        self._requested_port = port
        self.port = 0
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind, start serving and return the bound port."""
        sock = _bind(self._host, self._requested_port)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            AccessLog(self._app),
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,
            access_log=False,
            # The peer address is the client (admission's key), as on the gRPC port: no X-Forwarded-For.
            proxy_headers=False,
            server_header=False,
            timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
            limit_concurrency=self._max_connections,
            **self._tls,  # type: ignore[arg-type]
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()
                raise RuntimeError(f"the HTTP server on {self._host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        log.info("listening", service="gateway-http", address=f"{self._host}:{self.port}", tls=bool(self._tls))
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let open responses finish (briefly) and return once the server is down."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await self._task
        except Exception:
            log.exception("HTTP server failed while stopping")
        self._server = self._task = None
