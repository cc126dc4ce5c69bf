"""`meshserve up` never leaves its services behind: not when SIGKILLed, not when its stdout pipe is gone."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from services.common.ports import free_port
from tests.integration.test_cli_up import BANNER, CLI, wait_for_line

STARTUP_S = 300.0
# Bound on how long the orphaned services may take to drain and exit; not a measured latency.
EXIT_S = 90.0

# A process by pid and start time (clock ticks since boot), so a recycled pid is never mistaken for it.
Process = tuple[int, str]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name (state first), or None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _children(pid: int) -> set[Process]:
    found = set()
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and fields[1] == str(pid):
            found.add((int(entry.name), fields[19]))
    return found


def _running(process: Process) -> bool:
    fields = _stat(process[0])
    # A zombie has exited; whoever adopted it may simply not have reaped it yet.
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def _survivors(processes: set[Process], timeout: float) -> set[Process]:
    deadline = time.monotonic() + timeout
    while (alive := {p for p in processes if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _kill(processes: set[Process]) -> None:
    """Clean up after a failed test: only the exact processes it started."""
    for process in processes:
        if _running(process):
            subprocess.run(["kill", "-KILL", str(process[0])], check=False)


def _start_up(
    model: Path, log_dir: Path, *extra: str, stderr: int | IO[str] = subprocess.STDOUT
) -> subprocess.Popen[str]:
    ports = ["--port", str(free_port()), "--scheduler-port", str(free_port()), "--worker-port", str(free_port()),
             "--kv-store-port", str(free_port()), "--metrics-port", "0"]  # fmt: skip
    return subprocess.Popen(
        [*CLI, "up", "--model", str(model), *ports, "--log-dir", str(log_dir), "--kv-cache-memory", "64MiB", *extra],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def test_a_killed_launcher_takes_its_services_along(tiny_model_dir: Path, tmp_path: Path) -> None:
    up = _start_up(tiny_model_dir, tmp_path, "--workers", "2", "--kv-store", "off")
    services: set[Process] = set()
    try:
        wait_for_line(up, BANNER, STARTUP_S)
        services = _children(up.pid)
        assert len(services) == 4, "a scheduler, two workers and a gateway (no kvstore)"
        up.kill()
        up.wait()
        assert not _survivors(services, EXIT_S), "services outlived their SIGKILLed launcher"
    finally:
        up.kill()
        up.wait()
        _kill(services)


def test_ctrl_c_stops_every_service_when_stdout_is_gone(tiny_model_dir: Path, tmp_path: Path) -> None:
    errors = tmp_path / "up.stderr"
    with errors.open("w") as stderr:
        up = _start_up(tiny_model_dir, tmp_path, stderr=stderr)
    services: set[Process] = set()
    try:
        wait_for_line(up, BANNER, STARTUP_S)
        services = _children(up.pid)
        assert len(services) == 4, "a kvstore, a scheduler, a worker and a gateway"
        assert up.stdout is not None
        up.stdout.close()  # `| tee` dies first on Ctrl-C: the "stopping..." line meets a closed pipe
        up.send_signal(signal.SIGINT)
        assert up.wait(EXIT_S) == 0, errors.read_text()
        assert not _survivors(services, 0), "the launcher exited before stopping its services"
        assert "Error" not in errors.read_text()
    finally:
        up.kill()
        up.wait()
        _kill(services)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def test_a_dead_worker_leaves_the_suite_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    errors = tmp_path / "up.stderr"
    port = free_port()
    with errors.open("w") as stderr:
        up = subprocess.Popen(
            [*CLI, "up", "--model", str(tiny_model_dir), "--port", str(port), "--scheduler-port", str(free_port()),
             "--worker-port", str(free_port()), "--log-dir", str(tmp_path), "--kv-cache-memory", "64MiB",
             "--workers", "2", "--metrics-port", "0"],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    services: set[Process] = set()
    try:
        wait_for_line(up, BANNER, STARTUP_S)
        services = _children(up.pid)
        [victim] = [p for p in services if "worker-1" in _cmdline(p[0])]
        subprocess.run(["kill", "-KILL", str(victim[0])], check=True)
        assert not _survivors({victim}, EXIT_S)
        # The rest serves on: a request through the gateway completes on worker-0.
        reply = subprocess.run(
            [*CLI, "generate", "--raw", "--address", f"127.0.0.1:{port}", "--max-tokens", "4", "--temperature", "0",
             "hi"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert reply.returncode == 0, reply.stderr
        deadline = time.monotonic() + EXIT_S
        while "worker-1 exited" not in errors.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)  # up looks at its children once a second
        assert "worker-1 exited" in errors.read_text()
        assert up.poll() is None, "up stopped the whole suite for one worker"
        up.send_signal(signal.SIGINT)
        assert up.wait(EXIT_S) == 0, errors.read_text()
    finally:
        up.kill()
        up.wait()
        _kill(services)
