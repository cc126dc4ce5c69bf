"""Starts meshserve services as child processes and waits for their health checks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import open_channel
from services.common.tls import Security

if TYPE_CHECKING:
    from services.client.dev_certs import DevCerts

# Runs in each child before it becomes `python -m services.cli ...` (argv: launcher pid, then the real
# command). PR_SET_PDEATHSIG makes Linux send SIGTERM to the child when the launcher dies by any
# means (SIGKILL, a closed pipe, a crash), so no service outlives it; the signal setting survives
# execve. It is set here, in the child's own single-threaded interpreter, rather than in a Popen
# preexec_fn, which is not safe to run between fork and exec in a process with threads. If the
# launcher died before prctl ran, nobody would ever send the signal: then the child does not start.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
try:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
except (OSError, AttributeError):
    pass  # not Linux: the launcher's own stop_all is the only guarantee
if os.getppid() != int(sys.argv[1]):
    sys.exit("meshserve: the launcher exited before this service started")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def die_with_parent_command(python_args: Sequence[str]) -> list[str]:
    """`python PYTHON_ARGS` for Popen, as a child that gets SIGTERM when this process dies."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *python_args]


@dataclass
class ServiceProcess:
    """One running service."""

    name: str
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path
    # The `meshserve` arguments it runs with (process.args also holds the die-with-parent wrapper),
    # e.g. to start it again.
    args: list[str] = field(default_factory=list)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the service's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Launcher:
    """Owns the child processes of `meshserve up` (and of integration tests)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, security: Security | None = None) -> None:
        """`security`: the TLS client certificate (and token) health checks use (None: insecure)."""
        self.log_dir = log_dir
        self.security = security
        self.env = {**os.environ, **(env or {})}
        self.services: list[ServiceProcess] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str], address: str) -> ServiceProcess:
        """Run `python -m services.cli ARGS` with its log in log_dir/NAME.log; it dies with this process.

        Call it from the main thread: Linux sends the death signal when the thread that forked the
        child exits, so a child started from a short-lived thread would be stopped with that thread.
        """
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                die_with_parent_command(["-m", "services.cli", *args]),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # Ctrl-C reaches us only; we stop children in order
            )
        service = ServiceProcess(name, address, process, log_path, list(args))
        self.services.append(service)
        return service

    async def wait_healthy(self, service: ServiceProcess, timeout: float) -> None:
        """Poll grpc.health.v1 until SERVING; fail early, with its log, if the process exits."""
        deadline = time.monotonic() + timeout
        async with open_channel(service.address, self.security) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if service.process.poll() is not None:
                    raise RuntimeError(
                        f"{service.name} exited with code {service.process.returncode}; "
                        f"its log ({service.log_path}) ends with:\n{service.log_tail()}"
                    )
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{service.name} at {service.address} not SERVING after {timeout:.0f}s; "
                        f"its log ends with:\n{service.log_tail()}"
                    )
                await asyncio.sleep(0.2)

    def stop(self, service: ServiceProcess, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL after timeout."""
        proc = service.process
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop_all(self, timeout: float = 30.0) -> None:
        """Stop in reverse start order: the gateway first, the workers last."""
        for service in reversed(self.services):
            self.stop(service, timeout)
        self.services.clear()


@dataclass
class SuiteProcesses:
    """The processes of one suite: a kvstore (optional), a scheduler, its workers and a gateway."""

    scheduler: ServiceProcess
    workers: list[ServiceProcess]
    gateway: ServiceProcess
    kv_store: ServiceProcess | None = None

    @property
    def all(self) -> list[ServiceProcess]:
        """In start order."""
        first = [self.kv_store] if self.kv_store is not None else []
        return [*first, self.scheduler, *self.workers, self.gateway]


def metrics_ports(base: int, num_workers: int) -> dict[str, int]:
    """One metrics port per service from a base: gateway, scheduler, kvstore, then worker-0, worker-1, ..."""
    names = ["gateway", "scheduler", "kvstore", *(f"worker-{i}" for i in range(num_workers))]
    return {name: base + i for i, name in enumerate(names)}


def start_suite_processes(
    launcher: Launcher,
    *,
    model: str,
    host: str,
    scheduler_port: int,
    worker_ports: Sequence[int],
    gateway_port: int,
    common_args: Sequence[str] = (),
    scheduler_args: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    kv_store_port: int | None = None,
    kv_store_args: Sequence[str] = (),
    certs: DevCerts | None = None,
    metrics_port: int | None = None,
    worker_model: str | None = None,
) -> SuiteProcesses:
    """Start a kvstore (with kv_store_port), scheduler, one worker per port (ids worker-0, worker-1, ...) and
    gateway; no waiting. With a kvstore, the scheduler and every worker get --kv-store. With certs, each
    service gets its own certificate and the CA (mTLS on every internal hop). With metrics_port, each
    service exports Prometheus metrics on its own port (metrics_ports says which). worker_model, when given,
    is the workers' --model (a GGUF file of the gateway's model, say) and model the gateway's only."""
    sched_addr = f"{host}:{scheduler_port}"
    base = ["--host", host, *common_args]
    ports = metrics_ports(metrics_port, len(worker_ports)) if metrics_port is not None else {}

    def own_flags(name: str) -> list[str]:
        """The flags that differ per service: its certificate and its metrics port."""
        flags = [] if certs is None else certs.flags(name.split("-")[0])
        return flags + (["--metrics-port", str(ports[name])] if name in ports else [])

    kv_store = None
    store_flags: list[str] = []
    if kv_store_port is not None:
        store_addr = f"{host}:{kv_store_port}"
        kv_store = launcher.start(
            "kvstore",
            ["kvstore", *base, *own_flags("kvstore"), "--port", str(kv_store_port), *kv_store_args],
            store_addr,
        )
        store_flags = ["--kv-store", store_addr]
    scheduler = launcher.start(
        "scheduler",
        ["scheduler", *base, *own_flags("scheduler"), "--port", str(scheduler_port), *store_flags, *scheduler_args],
        sched_addr,
    )
    workers = [
        launcher.start(
            f"worker-{i}",
            [
                "worker",
                *base,
                *own_flags(f"worker-{i}"),
                "--port",
                str(port),
                "--scheduler-address",
                sched_addr,
                "--model",
                worker_model or model,
                "--worker-id",
                f"worker-{i}",
                *store_flags,
                *worker_args,
            ],
            f"{host}:{port}",
        )
        for i, port in enumerate(worker_ports)
    ]
    gateway = launcher.start(
        "gateway",
        [
            "gateway",
            *base,
            *own_flags("gateway"),
            "--port",
            str(gateway_port),
            "--scheduler-address",
            sched_addr,
            "--model",
            model,
            *gateway_args,
        ],
        f"{host}:{gateway_port}",
    )
    return SuiteProcesses(scheduler, workers, gateway, kv_store)


async def wait_all_healthy(launcher: Launcher, services: Sequence[ServiceProcess], timeout: float) -> None:
    """Wait until every service is SERVING (fails as soon as one exits)."""
    await asyncio.gather(*(launcher.wait_healthy(s, timeout) for s in services))
