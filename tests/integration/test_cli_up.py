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
