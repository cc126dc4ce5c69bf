"""What a scrape returns (text format, constant labels, vLLM copies) and the /metrics-only port."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics.exposition import CONTENT_TYPE, Exposition
from services.common.metrics.metrics_server import MetricsServer

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("meshserve:request_success", "x", ["finished_reason"], registry=registry).labels("stop").inc(3)
    Gauge("meshserve:num_requests_waiting", "x", registry=registry).set(7)
    Gauge("meshserve:num_workers", "x", registry=registry).set(2)  # no vLLM counterpart
    Histogram("meshserve:time_to_first_token_seconds", "x", buckets=(0.1, 1.0), registry=registry).observe(0.5)
    return registry


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_names_keep_their_colon_and_no_created_series() -> None:
    text = Exposition([_registry()]).render().decode()
    assert "meshserve:request_success_total{" in text and "meshserve_request_success" not in text
    assert "_created" not in text
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_constant_labels_are_read_at_every_scrape() -> None:
    name = {"model_name": ""}
    exposition = Exposition([_registry()], constant_labels=lambda: dict(name))
    name["model_name"] = "smollm2"
    samples = _samples(exposition.render().decode())
    assert samples[("meshserve:num_requests_waiting", frozenset({("model_name", "smollm2")}))] == 7
    assert not any(("model_name", "") in labels for _, labels in samples)


def test_the_vllm_alias_copies_only_vllm_names_with_the_same_values() -> None:
    plain = _samples(Exposition([_registry()]).render().decode())
    aliased = _samples(Exposition([_registry()], vllm_alias=True).render().decode())
    copies = {(n.replace("vllm:", "meshserve:", 1), labels): v for (n, labels), v in aliased.items() if "vllm:" in n}
    assert copies == {key: value for key, value in plain.items() if "num_workers" not in key[0]}
    assert not any(n.startswith("vllm:num_workers") for n, _ in aliased)


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    running = MetricsServer(Exposition([_registry()]), "127.0.0.1", 0).start()
    yield running
    running.stop()


def _get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_the_port_serves_metrics_at_slash_metrics_only(server: MetricsServer) -> None:
    base = f"http://127.0.0.1:{server.port}"
    status, headers, body = _get(f"{base}/metrics", Accept=OPENMETRICS)
    assert status == 200 and headers["Content-Type"] == CONTENT_TYPE
    assert b"meshserve:num_requests_waiting 7.0" in body
    assert _get(f"{base}/metrics?name[]=x")[0] == 200
    for path in ("/", "/healthz", "/metrics/", "/metricsx"):
        status, _, body = _get(base + path)
        assert status == 404 and b"/metrics" in body, path


def test_gzip_when_asked(server: MetricsServer) -> None:
    status, headers, body = _get(f"http://127.0.0.1:{server.port}/metrics", **{"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert b"meshserve:num_workers 2.0" in gzip.decompress(body)
