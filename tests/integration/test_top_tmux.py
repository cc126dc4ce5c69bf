"""`meshserve top` in a real terminal: tmux runs it against `meshserve up` on the tiny model, the test reads
the screen with capture-pane and quits it with the q key, as a user would."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.common.ports import free_port, free_port_block
from tests.support.calls import greedy_token_answers

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
CLI = [sys.executable, "-m", "services.cli"]
REPO = Path(__file__).resolve().parents[2]
# The last line `meshserve up` prints once every service is SERVING.
BANNER = "Ctrl-C stops every service"
# Polling deadlines, generous for a loaded CI machine; nothing asserts how long anything took.
STARTUP_S = 300.0
SCREEN_S = 60.0
WORKER_ROW = re.compile(r"^\s*worker-0\s+(up|serving)\b", re.MULTILINE)
GENERATED = re.compile(r"([\d,]+) tokens generated")
GEN_RATE = re.compile(r"gen ([\d.]+) tok/s")


def _wait_until(what: str, check: Callable[[], str | None], timeout: float, context: Callable[[], str]) -> str:
    """Poll check() until it returns text; AssertionError with context() when the deadline passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found is not None:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what} not seen within {timeout:.0f}s; last seen:\n{context()}")


@pytest.fixture
def up_suite(tiny_model_dir: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    """`meshserve up` with one worker and metrics on from a free BASE; its addresses and BASE."""
    base = free_port_block(4)  # gateway, scheduler, kvstore, worker-0
    ports: list[int] = []
    while len(ports) < 4:
        port = free_port()
        if port not in range(base, base + 4) and port not in ports:
            ports.append(port)
    gateway, scheduler, worker, kv_store = ports
    out = tmp_path / "up.out"
    with out.open("wb") as sink:
        up = subprocess.Popen(
            [
                *CLI,
                "up",
                str(tiny_model_dir),
                "--port",
                str(gateway),
                "--scheduler-port",
                str(scheduler),
                "--worker-port",
                str(worker),
                "--kv-store-port",
                str(kv_store),
                "--http-port",
                "-1",
                "--metrics-port",
                str(base),
                "--kv-cache-memory",
                "64MiB",
                "--log-dir",
                str(tmp_path / "logs"),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def printed() -> str:
        return out.read_text(errors="replace")

    try:

        def ready() -> str | None:
            assert up.poll() is None, f"meshserve up exited with {up.returncode}:\n{printed()}"
            return printed() if BANNER in printed() else None

        _wait_until("the banner of meshserve up", ready, STARTUP_S, printed)
        yield {
            "gateway": f"127.0.0.1:{gateway}",
            "scheduler": f"127.0.0.1:{scheduler}",
            "metrics_port": str(base),
        }
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def test_top_shows_the_worker_and_the_generated_tokens_then_q_quits(up_suite: dict[str, str]) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    answers = asyncio.run(greedy_token_answers(up_suite["gateway"], prompts, max_tokens=12))
    assert all(len(a.token_ids) == 12 for a in answers)

    socket_name = f"meshserve-top-{uuid.uuid4().hex[:12]}"
    tmux = ["tmux", "-L", socket_name, "-f", os.devnull]
    command = shlex.join(
        [
            *CLI,
            "top",
            "--metrics-port",
            up_suite["metrics_port"],
            "--gateway",
            up_suite["gateway"],
            "--scheduler",
            up_suite["scheduler"],
            "--interval",
            "0.5",
        ]
    )
    # After top exits the shell prints its status and stays, so the pane (and its text) outlives it.
    shell = f"{command}; echo top exited rc=$?; sleep 600"

    def screen() -> str:
        return subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True, check=True
        ).stdout

    try:
        subprocess.run(
            [*tmux, "new-session", "-d", "-x", "160", "-y", "50", "-s", "top", "-c", str(REPO), shell],
            check=True,
        )

        def worker_and_tokens() -> str | None:
            text = screen()
            total = GENERATED.search(text)
            rate = GEN_RATE.search(text)
            generated = (total is not None and int(total.group(1).replace(",", "")) > 0) or (
                rate is not None and float(rate.group(1)) > 0
            )
            return text if WORKER_ROW.search(text) and generated else None

        shown = _wait_until("worker-0's row and generated tokens", worker_and_tokens, SCREEN_S, screen)
        assert "meshserve top" in shown
        assert re.search(r"scheduler SERVING", shown), shown
        assert re.search(r"gateway SERVING", shown), shown

        subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True)

        def exited() -> str | None:
            found = re.search(r"top exited rc=(\d+)", screen())
            return found.group(1) if found else None

        assert _wait_until("top's exit after q", exited, SCREEN_S, screen) == "0"
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
