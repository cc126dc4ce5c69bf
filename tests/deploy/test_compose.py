"""deploy/compose: compose.yaml, and compose.yaml with compose.ascend.yaml over it, against the Compose
Specification's JSON schema (the copy check-jsonschema vendors), plus what `up --scale worker=N`, the start
order and the Ascend devices need. No Docker here: the override is merged the way compose merges the keys
these files use (and the test refuses keys the merge below does not know)."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "deploy" / "compose"
BASE = COMPOSE_DIR / "compose.yaml"
ASCEND = COMPOSE_DIR / "compose.ascend.yaml"
OUR_SERVICES = {"gateway": 50051, "scheduler": 50052, "worker": 50053, "kvstore": 50054}
ASCEND_DEVICES = {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
ASCEND_HOST_MOUNTS = {
    "/usr/local/Ascend/driver",
    "/usr/local/dcmi",
    "/usr/local/bin/npu-smi",
    "/etc/ascend_install.info",
}


def load(path: Path) -> dict[str, Any]:
    # safe_load resolves the `<<:` merge keys compose files use.
    data: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data


def compose_schema() -> dict[str, Any]:
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: dict[str, Any] = json.loads(vendor.joinpath("compose-spec.json").read_text(encoding="utf-8"))
    return schema


# --- merging an override as `docker compose -f a -f b` does -----------------------------------------------

# Compose's merge rules (compose-spec "merge.md") for the service keys these files use.
REPLACED = {"image", "command", "entrypoint", "restart", "stop_grace_period", "container_name", "user"}
MAPPINGS = {"environment", "deploy", "build", "healthcheck", "depends_on", "labels"}
UNIQUE_SEQUENCES = {"devices", "group_add", "ports", "expose", "dns"}


def _volume_target(entry: str | dict[str, Any]) -> str:
    if isinstance(entry, dict):
        return str(entry["target"])
    return entry.split(":")[1] if ":" in entry else entry


def merge_service(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if key in REPLACED:
            merged[key] = value
        elif key in MAPPINGS:
            target = merged.setdefault(key, {})
            for inner, inner_value in value.items():
                # healthcheck.test is a command (replaced); nested mappings (deploy.resources) merge.
                if isinstance(inner_value, dict) and isinstance(target.get(inner), dict):
                    target[inner] = {**target[inner], **inner_value}
                else:
                    target[inner] = inner_value
        elif key in UNIQUE_SEQUENCES:
            merged[key] = list(dict.fromkeys([*merged.get(key, []), *value]))
        elif key == "volumes":
            # Merged by container path: an override's mount replaces the base's at the same target.
            by_target = {_volume_target(v): v for v in merged.get("volumes", [])}
            by_target.update({_volume_target(v): v for v in value})
            merged["volumes"] = list(by_target.values())
        else:
            pytest.fail(f"the override uses service key {key!r}, which this test's merge does not implement")
    return merged


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    assert set(override) <= {"services"}, "the override should change services only"
    for name, service in override["services"].items():
        assert name in merged["services"], f"the override adds a service {name!r} instead of changing one"
        merged["services"][name] = merge_service(merged["services"][name], service)
    return merged


def test_merge_follows_compose_rules() -> None:
    """The merge that the Ascend checks rely on: scalars replaced, environment merged, devices appended,
    volumes merged by their container path."""
    base = {"services": {"w": {"image": "a", "environment": {"A": "1", "B": "2"}, "volumes": ["x:/m", "y:/k"]}}}
    override = {
        "services": {"w": {"image": "b", "environment": {"B": "3"}, "devices": ["/dev/d"], "volumes": ["z:/m"]}}
    }
    w = merge(base, override)["services"]["w"]
    assert w["image"] == "b"
    assert w["environment"] == {"A": "1", "B": "3"}
    assert w["devices"] == ["/dev/d"]
    assert sorted(w["volumes"]) == ["y:/k", "z:/m"]


# --- schema -----------------------------------------------------------------------------------------------


def _validate(document: dict[str, Any]) -> None:
    schema = compose_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    errors = sorted(validator_class(schema).iter_errors(document), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_compose_file_matches_the_compose_specification() -> None:
    _validate(load(BASE))


def test_ascend_override_merged_matches_the_compose_specification() -> None:
    _validate(merge(load(BASE), load(ASCEND)))


def test_the_schema_rejects_a_broken_file() -> None:
    broken = load(BASE)
    broken["services"]["worker"]["deploy"]["replicas"] = "two"
    broken["services"]["worker"]["depends_on"]["scheduler"]["condition"] = "service_ready"
    with pytest.raises(AssertionError):
        _validate(broken)


# --- what the stack needs ---------------------------------------------------------------------------------


def test_worker_scales_without_collisions() -> None:
    for document in (load(BASE), merge(load(BASE), load(ASCEND))):
        worker = document["services"]["worker"]
        # A fixed name or host port is taken by the first replica; `--scale worker=2` would fail on the second.
        assert "container_name" not in worker
        assert "ports" not in worker
        assert "hostname" not in worker  # every replica's worker id is its own container hostname
        assert worker["deploy"]["replicas"] >= 1


def test_workers_share_the_kvstores_shared_memory() -> None:
    for document in (load(BASE), merge(load(BASE), load(ASCEND))):
        services = document["services"]
        # Every replica joins the store's IPC namespace, whose /dev/shm holds one 32 MiB outbox per rank.
        assert services["worker"]["ipc"] == "service:kvstore"
        assert services["kvstore"]["ipc"] == "shareable"
        size = services["kvstore"]["shm_size"]
        assert re.fullmatch(r"\d+m", size) and int(size[:-1]) >= 4 * 32


def test_public_ports_are_the_gateways() -> None:
    services = load(BASE)["services"]
    assert services["gateway"]["ports"] == ["50051:50051", "8000:8000"]
    assert services["gateway"]["environment"]["MESHSERVE_HTTP_PORT"] == "8000"
    for name in ("kvstore", "scheduler", "worker", "redis"):
        assert "ports" not in services[name], f"{name} is internal"


def test_every_service_listens_where_it_is_probed_and_scraped() -> None:
    services = load(BASE)["services"]
    for name, port in OUR_SERVICES.items():
        service = services[name]
        env = service["environment"]
        assert env["MESHSERVE_PORT"] == str(port)
        assert env["MESHSERVE_HOST"] == "0.0.0.0"
        assert env["MESHSERVE_METRICS_PORT"] == "9400"
        assert service["healthcheck"]["test"] == ["CMD", "meshserve", "health"], name
        # Longer than the drain, or compose's 10 s default SIGKILLs a service that is finishing requests.
        grace = float(env["MESHSERVE_SHUTDOWN_GRACE_PERIOD"])
        stop = service["stop_grace_period"]
        assert re.fullmatch(r"\d+s", stop) and int(stop[:-1]) > grace, name
    # The scrape config (deploy/prometheus) names these services and the port they export on.
    scrape = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    for job in scrape["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in services and port == services[host]["environment"]["MESHSERVE_METRICS_PORT"]
        for dns in job.get("dns_sd_configs", []):
            assert set(dns["names"]) <= set(services) and str(dns["port"]) == "9400"


def test_start_order_follows_health() -> None:
    services = load(BASE)["services"]

    def condition(name: str, on: str) -> str:
        return str(services[name]["depends_on"][on]["condition"])

    assert condition("kvstore", "redis") == "service_healthy"
    assert condition("scheduler", "kvstore") == "service_healthy"
    # A scheduler is healthy (SERVING) only once a worker has attached: waiting for it would deadlock.
    assert condition("worker", "scheduler") == "service_started"
    assert condition("gateway", "scheduler") == "service_healthy"
    for name in ("worker", "gateway"):
        assert condition(name, "model-init") == "service_completed_successfully"
    assert condition("grafana", "prometheus") == "service_healthy"


def test_images_and_mounts_exist_in_the_repository() -> None:
    for path in (BASE, ASCEND):
        for name, service in load(path)["services"].items():
            image = service.get("image", "")
            assert image and not image.endswith(":latest") and ":" in image, f"{name}: pin {image!r}"
            build = service.get("build")
            if build:
                context = (COMPOSE_DIR / build["context"]).resolve()
                assert context == REPO
                assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']}"
            for volume in service.get("volumes", []):
                source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
                if source.startswith("."):
                    # Bind mounts of this repository's files: a missing one would be created empty by Docker.
                    resolved = (COMPOSE_DIR / source).resolve()
                    assert resolved.exists(), f"{name} mounts {source}, which is not in the repository"
                    assert resolved.is_relative_to(REPO / "deploy"), source


def test_named_volumes_are_declared_and_the_model_cache_is_shared() -> None:
    document = load(BASE)
    declared = set(document["volumes"])
    for name, service in document["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith(("/", ".")):
                assert source in declared, f"{name} uses undeclared volume {source}"
    services = document["services"]
    assert "models:/models" in services["model-init"]["volumes"]
    assert "models:/models" in services["worker"]["volumes"]
    assert "models:/models:ro" in services["gateway"]["volumes"]


def test_ascend_override_brings_the_npus_and_the_driver() -> None:
    worker = merge(load(BASE), load(ASCEND))["services"]["worker"]
    assert worker["image"].startswith("meshserve/worker-ascend:")
    assert worker["build"]["dockerfile"] == "deploy/docker/Dockerfile.ascend"
    devices = set(worker["devices"])
    assert devices >= ASCEND_DEVICES
    npus = {d for d in devices if re.fullmatch(r"/dev/davinci\d+", d)}
    assert npus, "no /dev/davinciN"
    env = worker["environment"]
    assert env["MESHSERVE_DEVICE"] == "npu"
    # One rank per NPU handed to the container.
    assert int(env["MESHSERVE_TENSOR_PARALLEL_SIZE"]) == len(npus)
    mounts = {v.split(":")[0]: v for v in worker["volumes"] if isinstance(v, str)}
    for path in ASCEND_HOST_MOUNTS:
        assert mounts.get(path) == f"{path}:{path}:ro", f"{path} is not mounted read-only at the same path"
    # The CPU worker's own mounts are still there (the merge keeps them).
    assert "models:/models" in worker["volumes"]
    assert worker["group_add"], "the unprivileged user needs the device nodes' group"
