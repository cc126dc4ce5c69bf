"""The metrics port: `/metrics` and nothing else.

prometheus-client's start_http_server answers every path with the metrics and 200, so an `httpGet` probe
pointed at a wrong path on that port always passes. Here any other path is a 404. The server runs on its
own threads, as prometheus-client's does: a slow scraper never touches a service's event loop.
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from services.common.metrics.exposition import CONTENT_TYPE, Exposition

METRICS_PATH = "/metrics"


class MetricsServer:
    """An HTTP server on host:port that serves one Exposition at /metrics."""

    def __init__(self, exposition: Exposition, host: str, port: int) -> None:
        handler = _handler_for(exposition)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        """Serve in the background; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()


def _handler_for(exposition: Exposition) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(send_body=True)

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def _answer(self, *, send_body: bool) -> None:
            if urlsplit(self.path).path != METRICS_PATH:
                self._plain(404, f"not found: metrics are served at {METRICS_PATH}\n", send_body)
                return
            body = exposition.render()
            encoding = None
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body, encoding = gzip.compress(body), "gzip"
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            if encoding:
                self.send_header("Content-Encoding", encoding)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def _plain(self, status: int, text: str, send_body: bool) -> None:
            body = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            # A scrape every few seconds is not worth a log line.
            pass

    return Handler
