"""A worker's ranks from the outside, for the tensor- and pipeline-parallel suites: its spawned rank processes,
a startup it must refuse, and one worker spread over two "nodes" on loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from services.client.launcher import Launcher, start_suite_processes, wait_all_healthy
from services.common.ports import free_port
from tests.support.calls import greedy_token_answers


def spawned_ranks(pid: int) -> list[int]:
    """The worker's rank processes: they run multiprocessing's spawn_main (a resource tracker may be a child too)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def worker_startup_error(model_dir: Path, *args: str) -> str:
    """Run a worker that must refuse to start (exit 1, no traceback); returns its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "worker", "--model", str(model_dir), "--port", "0",
         "--scheduler-address", "127.0.0.1:9", "--log-format", "json", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def two_node_greedy(
    model_dir: Path, log_dir: Path, worker_args: Sequence[str], prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[list[int]]:
    """One worker over --nnodes 2 on loopback (node 0 attaches and leads, node 1 is a separate worker command
    that only follows): greedy answers through the suite; then stopping node 0 must end node 1 cleanly."""
    multi = [*worker_args, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    launcher = Launcher(log_dir, env={"MESHSERVE_LOG_FORMAT": "json"})
    try:
        procs = start_suite_processes(
            launcher,
            model=str(model_dir),
            host="127.0.0.1",
            scheduler_port=free_port(),
            worker_ports=[free_port()],
            gateway_port=free_port(),
            worker_args=[*multi, "--node-rank", "0"],
        )
        node1_port = free_port()
        node1 = launcher.start(
            "worker-node1",
            ["worker", "--host", "127.0.0.1", "--port", str(node1_port), "--model", str(model_dir), *multi,
             "--node-rank", "1"],
            f"127.0.0.1:{node1_port}",
        )  # fmt: skip
        asyncio.run(wait_all_healthy(launcher, [*procs.all, node1], 300))
        answers = asyncio.run(greedy_token_answers(procs.gateway.address, prompts, max_tokens))
        launcher.stop(procs.workers[0])
        assert node1.process.wait(timeout=60) == 0, node1.log_tail()
    finally:
        launcher.stop_all(timeout=10)
    return [a.token_ids for a in answers]
