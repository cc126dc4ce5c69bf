"""Running `npu-smi`, one way for every caller (CPU binding's topology, device telemetry).

Found on PATH, never run through a shell, with a timeout that kills it and anything it started; a
failure or a refusal ("This device does not support querying ...") comes back as a reason, never raised.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NPU_SMI = "npu-smi"
# npu-smi's refusals read "This device does not support querying <what>."; match loosely across versions.
UNSUPPORTED = re.compile(r"does\s+not\s+support|not\s+supported", re.IGNORECASE)

# (command, timeout seconds) -> the finished process; tests pass their own.
CommandRunner = Callable[[Sequence[str], float], subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class NpuSmiFailure:
    """npu-smi gave no output to parse: absent, failed, timed out or refused."""

    reason: str


def refusal(text: str) -> str | None:
    """`npu-smi: <first line>` when the text is a refusal, else None."""
    if not UNSUPPORTED.search(text):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"npu-smi: {first}"


def run_npu_smi(args: Sequence[str], timeout: float, runner: CommandRunner | None = None) -> str | NpuSmiFailure:
    """stdout of `npu-smi ARGS`, or why there is none."""
    path = shutil.which(NPU_SMI) if runner is None else (shutil.which(NPU_SMI) or NPU_SMI)
    if path is None:
        return NpuSmiFailure("npu-smi not found")
    run = runner or _run_subprocess
    try:
        proc = run((path, *args), timeout)
    except FileNotFoundError:
        return NpuSmiFailure("npu-smi not found")
    except subprocess.TimeoutExpired:
        return NpuSmiFailure(f"npu-smi timed out after {timeout:g}s")
    except OSError as exc:
        return NpuSmiFailure(f"npu-smi could not run: {exc}")
    if proc.returncode != 0:
        output = f"{proc.stdout or ''}\n{proc.stderr or ''}".strip()
        return NpuSmiFailure(refusal(output) or f"npu-smi exited {proc.returncode}: {output[:200]!r}")
    return proc.stdout or ""


def _run_subprocess(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    # A new session, so a timeout kills npu-smi and anything it started: a wrapper's children would keep
    # the pipes open and stretch the read past its timeout.
    with subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        encoding="utf-8",
        errors="replace",
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise
        return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
