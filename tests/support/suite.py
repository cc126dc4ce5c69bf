"""Start the whole suite (scheduler, workers, gateway) as real processes on free loopback ports."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from services.client.launcher import Launcher, ServiceProcess, start_suite_processes, wait_all_healthy
from services.common.channels import insecure_channel
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.support.kvstore import TEST_STORE_CAPACITY

if TYPE_CHECKING:
    from services.client.dev_certs import DevCerts

STARTUP_TIMEOUT_S = 300.0


@dataclass
class Suite:
    """Addresses and processes of one running suite."""

    launcher: Launcher
    scheduler: ServiceProcess
    workers: list[ServiceProcess]
    gateway: ServiceProcess
    log_dir: Path
    kv_store: ServiceProcess | None = None

    @property
    def address(self) -> str:
        """The gateway's address."""
        return self.gateway.address

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        """The scheduler's own counters and pool state."""
        async with insecure_channel(self.scheduler.address) as channel:
            stats: scheduler_pb2.SchedulerStats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=10
            )
            return stats

    async def wait_idle(self, timeout: float = 30.0) -> scheduler_pb2.SchedulerStats:
        """Poll until no request runs or waits; returns the stats then."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            stats = await self.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"suite not idle: {stats}")
            await asyncio.sleep(0.1)

    def log_records(self, name: str) -> list[dict[str, object]]:
        """Parsed JSON log lines of one service."""
        records = []
        for line in (self.log_dir / f"{name}.log").read_text().splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records

    def stop(self) -> None:
        """SIGTERM everything, gateway first."""
        self.launcher.stop_all(timeout=30)

    def add_worker(
        self, model_dir: Path, worker_args: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Start one more worker attached to this suite's scheduler (and its kvstore; not waited for)."""
        index = len(self.workers)
        if self.kv_store is not None:
            worker_args = ["--kv-store", self.kv_store.address, *worker_args]
        port = free_port()
        launcher = self.launcher if env is None else Launcher(self.log_dir, env={**self.launcher.env, **env})
        worker = launcher.start(
            f"worker-{index}",
            [
                "worker", "--host", "127.0.0.1", "--port", str(port), "--scheduler-address", self.scheduler.address,
                "--model", str(model_dir), "--worker-id", f"worker-{index}", *worker_args,
            ],
            f"127.0.0.1:{port}",
        )  # fmt: skip
        if launcher is not self.launcher:
            # Stopped with the rest of the suite.
            self.launcher.services.append(worker)
        self.workers.append(worker)
        return worker

    async def wait_running(self, worker_id: str) -> None:
        """Poll until the worker runs at least one request (the moment a fault test strikes)."""
        while not any(w.worker_id == worker_id and w.num_running for w in (await self.stats()).workers):
            await asyncio.sleep(0.01)

    async def wait_workers(self, ready: int, timeout: float = STARTUP_TIMEOUT_S) -> scheduler_pb2.SchedulerStats:
        """Poll until this many workers are READY at the scheduler."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                stats = await self.stats()
                if sum(w.state == "READY" for w in stats.workers) >= ready:
                    return stats
            except grpc.aio.AioRpcError as err:
                # A scheduler that is (re)starting answers nothing yet.
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"fewer than {ready} workers ready")
            await asyncio.sleep(0.1)


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_suite(
    model_dir: Path,
    log_dir: Path,
    *,
    scheduler_args: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    num_workers: int = 1,
    scheduler_port: int | None = None,
    kv_store_args: Sequence[str] | None = None,
    common_args: Sequence[str] = (),
    certs: DevCerts | None = None,
    metrics_port: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Suite:
    """Start and wait until every service reports SERVING; kv_store_args not None: with a kvstore.

    common_args go to every service; certs: each service gets its own (health checks use "client");
    metrics_port: the first of the services' metrics ports (launcher.metrics_ports); env: extra variables."""
    launcher = Launcher(
        log_dir,
        env={"MESHSERVE_LOG_FORMAT": "json", "MESHSERVE_LOG_LEVEL": "debug", **(env or {})},
        security=None if certs is None else certs.security(),
    )
    try:
        procs = start_suite_processes(
            launcher,
            model=str(model_dir),
            host="127.0.0.1",
            scheduler_port=scheduler_port or free_port(),
            worker_ports=[free_port() for _ in range(num_workers)],
            gateway_port=free_port(),
            scheduler_args=scheduler_args,
            worker_args=worker_args,
            gateway_args=gateway_args,
            kv_store_port=None if kv_store_args is None else free_port(),
            kv_store_args=[*TEST_STORE_CAPACITY, *(kv_store_args or ())],
            common_args=common_args,
            certs=certs,
            metrics_port=metrics_port,
        )
        asyncio.run(wait_all_healthy(launcher, procs.all, STARTUP_TIMEOUT_S))
    except BaseException:
        launcher.stop_all(timeout=10)
        raise
    return Suite(launcher, procs.scheduler, procs.workers, procs.gateway, log_dir, procs.kv_store)
