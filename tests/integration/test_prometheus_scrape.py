"""A real Prometheus server scraping a running suite: the documented names are what a query finds, the
counters and histograms move with requests, the vllm: aliases carry the same values, and a fake npu-smi
reporting 88 °C takes the seed's temperature alert from pending to firing under the shipped rules."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.client.launcher import metrics_ports
from services.common.ports import free_port, free_port_block
from tests.support.calls import greedy_token_answers
from tests.support.fake_npu_smi import DATA, install_fake_npu_smi, path_with
from tests.support.metric_catalogue import documented_metrics
from tests.support.suite import Suite, start_suite

REPO = Path(__file__).resolve().parents[2]
ALERT_RULES = REPO / "deploy" / "prometheus" / "rules" / "meshserve-alerts.yml"
HOT_CARD = DATA / "info_910b3_88c_derived.txt"
PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus is not installed (make deploy-tools)"),
]


@dataclass
class Prometheus:
    """A running Prometheus server and its HTTP API."""

    url: str
    process: subprocess.Popen[bytes]

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=promql)["result"])

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Poll until the query returns a series (no timing is asserted: the bound only ends a hung test)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"no result for {promql!r} within {timeout:g}s")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def suite(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Suite, int]]:
    """The tiny suite with a kvstore, every metrics port and vllm: aliases; npu-smi reports a card at 88 °C."""
    tmp = tmp_path_factory.mktemp("prom-suite")
    install_fake_npu_smi(tmp / "bin", HOT_CARD)
    base = free_port_block(4)
    running = start_suite(
        tiny_model_dir,
        tmp / "logs",
        worker_args=["--kv-cache-memory", "64MiB", "--device-telemetry", "npu", "--device-telemetry-interval", "1"],
        kv_store_args=[],
        common_args=["--metrics-vllm-alias"],
        metrics_port=base,
        env={"PATH": path_with(tmp / "bin")},
    )
    yield running, base
    running.stop()


@pytest.fixture(scope="module")
def prometheus(suite: tuple[Suite, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Debian's prometheus on a free loopback port, scraping every service each second under our alert rules."""
    assert PROMETHEUS is not None
    _, base = suite
    tmp = tmp_path_factory.mktemp("prometheus")
    jobs = {name.split("-")[0]: port for name, port in metrics_ports(base, 1).items()}
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(ALERT_RULES)],
        "scrape_configs": [
            {"job_name": f"meshserve-{job}", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for job, port in jobs.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = Prometheus(f"http://127.0.0.1:{port}", process)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp / "prometheus.log").read_text()) from None
                time.sleep(0.2)
        server.wait_for("count(up == 1) == 4", timeout=60)
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_the_metrics_move_and_their_names_survive_the_scrape(
    suite: tuple[Suite, int], prometheus: Prometheus, tiny_model_dir: Path
) -> None:
    running, _ = suite
    before = prometheus.value("sum(meshserve:worker_steps_total)") or 0.0
    # Keep requests running until a scrape has seen one in a running batch.
    seen_running: list[dict[str, Any]] = []
    for _ in range(20):
        asyncio.run(greedy_token_answers(running.address, [[5 + i, 6, 7, 8] for i in range(6)], max_tokens=200))
        seen_running = prometheus.query("max_over_time(meshserve:num_requests_running[5m]) > 0")
        if seen_running:
            break
    assert seen_running, "no scrape saw a running request"

    ttft = prometheus.wait_for('meshserve:time_to_first_token_seconds_count{job="meshserve-gateway"} > 0')
    assert ttft[0]["metric"]["model_name"] == tiny_model_dir.name
    prometheus.wait_for(
        'grpc_server_handled_total{job="meshserve-gateway",grpc_service="meshserve.v1.Generation",'
        'grpc_method="Generate",grpc_code="OK"} > 0'
    )
    prometheus.wait_for(f'sum(meshserve:worker_steps_total{{job="meshserve-worker"}}) > {before}')
    prometheus.wait_for('meshserve:worker_step_duration_seconds_count{job="meshserve-worker",worker="worker-0"} > 0')
    prometheus.wait_for('meshserve:request_queue_time_seconds_count{job="meshserve-scheduler"} > 0')

    # What Prometheus stored is what docs/metrics.md promises: the `:` survived, nothing was escaped to `_`.
    stored = set(prometheus.api("label/__name__/values"))
    assert not {n for n in stored if n.startswith(("meshserve_", "vllm_"))}, "a name was escaped"
    documented = {m.name for m in documented_metrics()}
    for name in ("meshserve:num_requests_running", "meshserve:kv_cache_usage_perc", "meshserve:worker_steps_total",
                 "meshserve:device_temperature_celsius", "meshserve:kvstore_backend_serving",
                 "grpc_server_handled_total"):  # fmt: skip
        assert name in stored and name in documented, name
    # Every stored name of ours (vllm: copies included) is a documented one, or a documented histogram's series.
    kinds = {m.name: m.type for m in documented_metrics()}
    for name in stored:
        if not name.startswith(("meshserve:", "vllm:")):
            continue
        ours = name.replace("vllm:", "meshserve:", 1)
        base = next((ours.removesuffix(s) for s in ("_bucket", "_sum", "_count") if ours.endswith(s)), ours)
        assert ours in kinds or kinds.get(base) == "histogram", name


def test_the_vllm_aliases_carry_the_same_values(prometheus: Prometheus) -> None:
    prometheus.wait_for("vllm:time_to_first_token_seconds_count > 0")
    names = (
        "time_to_first_token_seconds_count",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "generation_tokens_total",
        "request_queue_time_seconds_sum",
    )
    for name in names:
        # Both copies come from one scrape of one target, so they are equal at every instant.
        paired = prometheus.query(f"vllm:{name} - on(job, instance, model_name) meshserve:{name}")
        assert paired and all(float(p["value"][1]) == 0.0 for p in paired), name
    assert prometheus.query("vllm:num_workers") == []  # vLLM has no such metric: no alias


def test_an_npu_at_88_degrees_takes_the_temperature_alert_to_firing(prometheus: Prometheus) -> None:
    hot = prometheus.wait_for('meshserve:device_temperature_celsius{platform="npu"} > 85')
    assert [(s["metric"]["card"], float(s["value"][1])) for s in hot] == [("4", 88.0)]
    states = set()
    deadline = time.monotonic() + 150  # `for: 1m` in the shipped rule, evaluated every second here
    while "firing" not in states:
        alerts = prometheus.api("alerts")["alerts"]
        states |= {a["state"] for a in alerts if a["labels"]["alertname"] == "MeshserveNpuTemperatureHigh"}
        assert time.monotonic() < deadline, f"temperature alert states seen: {states}"
        time.sleep(1)
    assert states == {"pending", "firing"}
    firing = [
        a for a in prometheus.api("alerts")["alerts"] if a["labels"]["alertname"] == "MeshserveNpuTemperatureHigh"
    ]
    assert {a["labels"]["card"] for a in firing} == {"4"}
