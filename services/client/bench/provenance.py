"""Where a benchmark ran: the commit of the checkout and the CPU, recorded beside its figures."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(root: Path) -> str | None:
    """HEAD of the checkout at root, with '+dirty' when files differ from it (None outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
