"""Children started by the launcher die with it, whatever kills it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

from services.client.launcher import die_with_parent_command

# Guards against a hang; no test measures time.
WAIT_S = 30.0

# A stand-in launcher: starts one sleeping child the way Launcher.start does, hands it the write end
# of the test's pipe (the pipe reads EOF once the child is gone), and waits to be killed.
PARENT = """
import os, subprocess, sys, time
from services.client.launcher import die_with_parent_command
pipe = int(sys.argv[1])
subprocess.Popen(die_with_parent_command(["-c", "import time; time.sleep(600)"]), pass_fds=(pipe,))
os.close(pipe)
print("started", flush=True)
time.sleep(600)
"""


def test_a_child_gets_sigterm_when_its_launcher_is_killed() -> None:
    read_end, write_end = os.pipe()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(write_end)], pass_fds=(write_end,), stdout=subprocess.PIPE, text=True
    )
    os.close(write_end)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline() == "started\n"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        readable, _, _ = select.select([read_end], [], [], WAIT_S)
        assert readable, "the child outlived its killed launcher"
        assert os.read(read_end, 1) == b""
    finally:
        parent.kill()
        parent.wait()
        os.close(read_end)


def test_a_child_whose_launcher_is_already_gone_does_not_start() -> None:
    command = die_with_parent_command(["-c", "print('ran')"])
    command[command.index(str(os.getpid()))] = "1"  # as if the launcher died and init adopted the child
    gone = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
    assert gone.returncode == 1
    assert "ran" not in gone.stdout
    assert "launcher exited" in gone.stderr


def test_a_child_of_a_live_launcher_runs_its_command() -> None:
    ran = subprocess.run(
        die_with_parent_command(["-c", "import sys; print('ran', sys.argv[1:])", "x"]),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "ran ['x']\n"
