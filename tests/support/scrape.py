"""A service's Prometheus exposition, fetched over HTTP as a scraper would."""

from __future__ import annotations

import urllib.request


def scrape_metrics(port: int, host: str = "127.0.0.1") -> str:
    """The text of http://host:port/metrics."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        text: str = reply.read().decode()
    return text
