"""`meshserve health` (the containers' HEALTHCHECK and exec probes) against real kvstore processes.

A kvstore is the cheapest real service: it is SERVING as soon as it listens, and its backend's health
name (`meshserve.v1.KVBlockStore.backend`) is NOT_SERVING while its Redis is unreachable, which gives a
real NOT_SERVING answer without waiting for anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from services.client.dev_certs import DevCerts, make_dev_certs
from services.client.health_probe import ProbeError, resolve_address
from services.client.launcher import Launcher, ServiceProcess
from services.common.ports import free_port
from services.kvstore.health import BACKEND_HEALTH_NAME, SERVICE_NAME
from tests.support.kvstore import kvstore_launcher, start_kvstore

PROBE_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("health-probe")


@pytest.fixture(scope="module")
def launcher(log_dir: Path) -> Iterator[Launcher]:
    launcher = kvstore_launcher(log_dir)
    yield launcher
    launcher.stop_all(timeout=10)


@pytest.fixture(scope="module")
def kvstore(launcher: Launcher) -> ServiceProcess:
    """A kvstore whose Redis backend points at a closed port: the store SERVING, its backend NOT_SERVING."""
    return start_kvstore(launcher, "kvstore-plain", backend=f"redis://127.0.0.1:{free_port()}/0")


@pytest.fixture(scope="module")
def certs(log_dir: Path) -> DevCerts:
    return make_dev_certs(log_dir / "certs")


@pytest.fixture(scope="module")
def tls_kvstore(log_dir: Path, certs: DevCerts) -> Iterator[ServiceProcess]:
    """A kvstore on mTLS (the CA given: client certificates are required on this internal port)."""
    # The launcher's own wait for SERVING needs a client certificate too.
    launcher = Launcher(log_dir, env={"MESHSERVE_LOG_FORMAT": "json"}, security=certs.security("client"))
    yield start_kvstore(launcher, "kvstore-tls", args=certs.flags("kvstore"))
    launcher.stop_all(timeout=10)


def probe(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`meshserve health ARGS` as a container runs it: a fresh process, without MESHSERVE_* from the tests."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "health", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )


def test_serving_service_exits_zero_and_prints_serving(kvstore: ServiceProcess) -> None:
    result = probe(kvstore.address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SERVING"
    named = probe(kvstore.address, "--service", SERVICE_NAME)
    assert (named.returncode, named.stdout.strip()) == (0, "SERVING")


def test_not_serving_exits_one_unless_only_liveness_is_asked(kvstore: ServiceProcess) -> None:
    result = probe(kvstore.address, "--service", BACKEND_HEALTH_NAME)
    assert result.returncode == 1
    assert result.stdout.strip() == "NOT_SERVING"
    alive = probe(kvstore.address, "--service", BACKEND_HEALTH_NAME, "--alive")
    assert (alive.returncode, alive.stdout.strip()) == (0, "NOT_SERVING")


def test_unknown_service_name_is_not_healthy(kvstore: ServiceProcess) -> None:
    result = probe(kvstore.address, "--service", "meshserve.v1.NoSuchService")
    assert result.returncode == 1
    assert result.stdout.startswith("SERVICE_UNKNOWN")


def test_closed_port_exits_nonzero_even_for_liveness() -> None:
    address = f"127.0.0.1:{free_port()}"
    for extra in ((), ("--alive",)):
        result = probe(address, "--timeout", "2", *extra)
        assert result.returncode == 1
        assert "no answer" in result.stderr and "UNAVAILABLE" in result.stderr
        assert result.stdout == ""


def test_address_defaults_to_the_service_variables(kvstore: ServiceProcess) -> None:
    port = kvstore.address.rsplit(":", 1)[1]
    # 0.0.0.0 (what the images set) means "every address": the probe dials the loopback.
    result = probe(env={"MESHSERVE_HOST": "0.0.0.0", "MESHSERVE_PORT": port})
    assert (result.returncode, result.stdout.strip()) == (0, "SERVING"), result.stderr
    missing = probe("--timeout", "2", env={"MESHSERVE_HOST": "0.0.0.0", "MESHSERVE_PORT": str(free_port())})
    assert missing.returncode == 1


def test_mtls_port_needs_the_certificate_from_the_service_variables(
    tls_kvstore: ServiceProcess, certs: DevCerts
) -> None:
    pair = certs.pair("kvstore")
    tls_env = {
        "MESHSERVE_TLS_CERT": str(pair.cert),
        "MESHSERVE_TLS_KEY": str(pair.key),
        "MESHSERVE_TLS_CA": str(certs.ca),
    }
    ok = probe(tls_kvstore.address, env=tls_env)
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    # The same with flags instead of variables.
    flags = probe(tls_kvstore.address, *certs.flags("client"))
    assert flags.returncode == 0, flags.stderr
    # Plaintext against a TLS port: no answer.
    plain = probe(tls_kvstore.address, "--timeout", "2")
    assert plain.returncode == 1
    # TLS without a client certificate: the internal port refuses the handshake.
    no_client_cert = probe(tls_kvstore.address, "--timeout", "2", env={"MESHSERVE_TLS_CA": str(certs.ca)})
    assert no_client_cert.returncode == 1


def test_bad_tls_file_is_reported_by_flag(kvstore: ServiceProcess, tmp_path: Path) -> None:
    result = probe(kvstore.address, "--tls-ca", str(tmp_path / "missing.pem"))
    assert result.returncode == 1
    assert "--tls-ca" in result.stderr and "no such file" in result.stderr


def test_address_from_pid1_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a container PID 1 is the service itself; its verb and --port give the address."""
    monkeypatch.delenv("MESHSERVE_HOST", raising=False)
    monkeypatch.delenv("MESHSERVE_PORT", raising=False)
    cmdline = tmp_path / "cmdline"

    def pid1(*argv: str) -> str:
        cmdline.write_bytes(b"".join(a.encode() + b"\0" for a in argv))  # /proc/PID/cmdline's layout
        return resolve_address(None, cmdline)

    assert pid1("/usr/local/bin/python3", "/usr/local/bin/meshserve", "scheduler", "--port", "6001") == "127.0.0.1:6001"
    assert pid1("meshserve", "kvstore", "--port=6002") == "127.0.0.1:6002"
    # --http-port is not the gRPC port: the gateway's default applies.
    assert pid1("meshserve", "gateway", "--http-port", "8000") == "127.0.0.1:50051"
    with pytest.raises(ProbeError, match="no address"):
        pid1("/bin/sh", "-c", "sleep 1")
