"""deploy/grafana: provisioning and the meshserve dashboard, against docs/metrics.md and a real PromQL parser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.metric_catalogue import promql_metric_names, undocumented_metric_names

REPO = Path(__file__).resolve().parents[2]
GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "meshserve.json"
DATASOURCES = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA_DIR / "provisioning" / "dashboards" / "meshserve.yml"
DATASOURCE_UID = "prometheus"
VARIABLE_QUERY = "label_values(meshserve:num_requests_running, model_name)"

# The panels issue 14 asks for, by title.
REQUIRED_PANELS = {
    "Request throughput",
    "Token throughput",
    "Time to first token (p50/p90/p99)",
    "Inter-token latency (p50/p90/p99)",
    "Queue: waiting and running",
    "KV cache usage (cluster)",
    "KV cache usage per worker",
    "Prefix cache hit rate",
    "Running requests per worker",
    "Requests routed per worker",
    "Device temperature per card",
    "Device power per card",
    "gRPC error rate",
}
# Grafana's variables, replaced by what Grafana would send so that promtool can parse the expression.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$model_name": ".*"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' collapsed children included."""
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def _queries(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in _panels(dashboard) if panel["type"] != "row"]


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in _queries(dashboard) for target in panel["targets"]]


def _variable(dashboard: dict[str, Any], name: str) -> dict[str, Any]:
    matches = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    assert len(matches) == 1, f"templating variable {name!r}"
    return matches[0]


def _variable_query(variable: dict[str, Any]) -> str:
    # Grafana 10+ stores the Prometheus variable query as an object, older releases as a string.
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def test_dashboard_shape(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "meshserve"
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and 36 <= dashboard["schemaVersion"] <= 41
    panels = _panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    # Grafana moves overlapping panels on load, so a layout that overlaps is not the one in the file.
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_panels_query_the_provisioned_prometheus(dashboard: dict[str, Any]) -> None:
    queries = _queries(dashboard)
    assert queries
    for panel in queries:
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']!r} has no targets"
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert isinstance(target.get("expr"), str) and target["expr"].strip(), panel["title"]
            assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE_UID, panel["title"]


def test_required_panels_exist(dashboard: dict[str, Any]) -> None:
    titles = [panel["title"] for panel in _panels(dashboard)]
    assert len(titles) == len(set(titles)), "panel titles must be unique"
    missing = REQUIRED_PANELS - set(titles)
    assert not missing, f"panels missing: {sorted(missing)}"


def test_model_name_variable(dashboard: dict[str, Any]) -> None:
    variable = _variable(dashboard, "model_name")
    assert variable["type"] == "query"
    assert variable["datasource"]["uid"] == DATASOURCE_UID
    assert _variable_query(variable) == VARIABLE_QUERY
    # "All" must match every model as a regex: the panels filter with model_name=~"$model_name".
    assert variable["includeAll"] and variable["allValue"] == ".*"


def test_model_scoped_panels_use_the_variable(dashboard: dict[str, Any]) -> None:
    # Every gateway/scheduler/worker series carries model_name (docs/metrics.md); the kvstore's and the
    # grpc_server_* series of the kvstore do not, so only meshserve: series outside the kvstore must filter.
    for expr in _exprs(dashboard):
        scoped = {n for n in promql_metric_names(expr) if n.startswith("meshserve:") and "kvstore_" not in n}
        if scoped:
            assert 'model_name=~"$model_name"' in expr, expr


def test_dashboard_metrics_are_documented(dashboard: dict[str, Any]) -> None:
    used: set[str] = set()
    for expr in _exprs(dashboard):
        names = promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        used |= names
    # label_values(metric, label): the metric is the first argument.
    match = re.fullmatch(r"label_values\((.+),\s*\w+\)", _variable_query(_variable(dashboard, "model_name")))
    assert match is not None
    used |= promql_metric_names(match.group(1))
    assert {"meshserve:device_temperature_celsius", "meshserve:device_power_watts", "grpc_server_handled_total"} <= used
    undocumented = undocumented_metric_names(used)
    assert not undocumented, "not in docs/metrics.md: " + ", ".join(sorted(undocumented))


def test_dashboard_exprs_parse(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """Every expression is valid PromQL once Grafana's variables are filled in: promtool parses each as a rule."""
    promtool = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if promtool is None:
        pytest.skip("promtool is not installed (make deploy-tools installs Debian's prometheus package)")
    rules = []
    for i, expr in enumerate(_exprs(dashboard)):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    result = subprocess.run(
        [promtool, "check", "rules", "--lint=none", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_datasource_provisioning() -> None:
    spec = yaml.safe_load(DATASOURCES.read_text(encoding="utf-8"))
    assert spec["apiVersion"] == 1
    [source] = spec["datasources"]
    assert (source["type"], source["uid"], source["url"]) == ("prometheus", DATASOURCE_UID, "http://prometheus:9090")
    assert source["access"] == "proxy"  # Grafana's server reaches prometheus:9090, a browser could not


def test_dashboard_provisioning() -> None:
    spec = yaml.safe_load(PROVIDERS.read_text(encoding="utf-8"))
    assert spec["apiVersion"] == 1
    [provider] = spec["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
