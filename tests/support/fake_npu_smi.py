"""A fake ``npu-smi`` for tests: an executable that prints a recorded ``npu-smi info`` output.

Put its directory first on PATH and the worker's device telemetry (and CPU binding) run it as they
would run the real tool. ``npu-smi info`` prints the recorded file (read on every run, so a test can
rewrite it between polls); ``npu-smi info -t <type>`` prints the refusal npu-smi gives for a query the
device does not support (the recorded ``topo_unsupported_openyuanrong_fixture.txt`` line for ``topo``),
so CPU binding falls back to sysfs NUMA quietly.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "npu_smi"
TOPO_UNSUPPORTED = DATA / "topo_unsupported_openyuanrong_fixture.txt"
FAKE_NAME = "npu-smi"

_SCRIPT = '''#!{python}
"""Fake npu-smi written by tests/support/fake_npu_smi.py; prints a recorded output."""
import sys
import time
from pathlib import Path

OUTPUT = Path({output!r})
EXIT_CODE = {exit_code!r}
DELAY_S = {delay_s!r}
TOPO_UNSUPPORTED = {topo!r}

args = sys.argv[1:]
if DELAY_S:
    time.sleep(DELAY_S)
if args == ["info"]:
    sys.stdout.write(OUTPUT.read_text())
    sys.stdout.flush()
    sys.exit(EXIT_CODE)
if len(args) == 3 and args[:2] == ["info", "-t"]:
    if args[2] == "topo":
        sys.stdout.write(TOPO_UNSUPPORTED)
    else:
        sys.stdout.write("This device does not support querying " + args[2] + ".\\n")
    sys.exit(0)
sys.stderr.write("fake npu-smi: unsupported arguments: " + " ".join(args) + "\\n")
sys.exit(2)
'''


def install_fake_npu_smi(directory: Path, output_file: Path, *, exit_code: int = 0, delay_s: float = 0.0) -> Path:
    """Write an executable ``npu-smi`` into ``directory`` that prints ``output_file`` for ``info``.

    ``exit_code`` is what ``info`` exits with; ``delay_s`` makes every call sleep first (a hung tool for
    timeout tests). Returns the script's path; put ``directory`` on PATH (``path_with``) to use it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / FAKE_NAME
    script.write_text(
        _SCRIPT.format(
            python=sys.executable,
            output=str(Path(output_file).resolve()),
            exit_code=int(exit_code),
            delay_s=float(delay_s),
            topo=TOPO_UNSUPPORTED.read_text(),
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def path_with(directory: Path, base: str | None = None) -> str:
    """A PATH value with ``directory`` first (then ``base``, default the current PATH)."""
    rest = os.environ.get("PATH", "") if base is None else base
    return os.pathsep.join(part for part in (str(directory), rest) if part)
