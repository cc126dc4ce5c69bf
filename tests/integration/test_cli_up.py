"""`meshserve up` then `meshserve generate` and `meshserve chat`, as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.ports import free_port, free_port_block

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "services.cli"]
# The last line `meshserve up` prints once every service is SERVING.
BANNER = "Ctrl-C stops every service"


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> str:
    """Read proc's stdout up to the line containing needle; all of it so far."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} not printed; output:\n{''.join(seen)}")


def test_up_generate_chat_and_ctrl_c(smollm2_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    up = subprocess.Popen(
        [
            *CLI,
            "up",
            "--port",
            str(port),
            "--scheduler-port",
            str(free_port()),
            "--worker-port",
            str(free_port()),
            "--kv-store-port",
            str(free_port()),
            "--http-port",
            str(free_port()),
            "--metrics-port",
            str(free_port_block(4)),
            "--log-dir",
            str(tmp_path),
            "--kv-cache-memory",
            "512MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        banner = wait_for_line(up, BANNER, timeout=300)
        assert f"127.0.0.1:{port}" in banner
        assert "starting a kvstore, scheduler" in banner
        address = ["--address", f"127.0.0.1:{port}"]
        gen = subprocess.run(
            [*CLI, "generate", "What is the capital of France?", "--temperature", "0", *address],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert "Paris" in gen.stdout
        assert "finish=stop" in gen.stderr
        chat = subprocess.run(
            [*CLI, "chat", "--temperature", "0", "--max-tokens", "20", *address],
            input="Hi!\nWhat is 2+2?\n",
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert chat.stdout.count("assistant> ") == 2
        bad = subprocess.run([*CLI, "generate", "x", "--top-p", "2", *address], capture_output=True, text=True)
        assert bad.returncode == 1
        assert "INVALID_ARGUMENT" in bad.stderr and "sampling.top_p" in bad.stderr
    finally:
        os.kill(up.pid, signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    assert up.returncode == 0, rest
    assert "stopping" in rest


def test_ctrl_c_while_starting_stops_every_service(tmp_path: Path) -> None:
    """Ctrl-C before the suite serves (a model still loading) stops it at once, not after --startup-timeout."""
    ports = {name: free_port() for name in ("port", "scheduler-port", "worker-port", "kv-store-port")}
    up = subprocess.Popen(
        [
            *CLI, "up", *(arg for name, port in ports.items() for arg in (f"--{name}", str(port))),
            "--http-port", "0", "--metrics-port", "0", "--log-dir", str(tmp_path), "--kv-cache-memory", "256MiB",
            "--startup-timeout", "3600",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        # Printed as the services start; the worker is still importing torch and loading the model.
        started = wait_for_line(up, "meshserve: starting", timeout=120)
        os.kill(up.pid, signal.SIGINT)
        rest, _ = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    output = started + rest
    assert up.returncode == 130, output
    assert BANNER not in output
    assert "interrupted before every service was serving" in output and "stopping" in output
    # No service it started is left: each one's command line names its own --port.
    for port in ports.values():
        found = subprocess.run(["pgrep", "-f", f"services.cli .* --port {port}( |$)"], capture_output=True, text=True)
        assert found.stdout.split() == [], f"a service on port {port} is still running"
