"""The committed stubs must be exactly what scripts/gen_protos.py makes from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "services" / "common" / "proto"


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    committed = {
        p.relative_to(STUBS): p.read_text() for p in STUBS.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    assert fresh.keys() == committed.keys(), "stub files differ: run `make protos`"
    stale = [str(name) for name, text in fresh.items() if committed[name] != text]
    assert not stale, f"stale stubs {stale}: run `make protos` after editing protos/"


def test_every_proto_field_is_commented() -> None:
    missing = []
    for proto in (ROOT / "protos").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "//"))
            if is_field and not lines[i - 1].strip().startswith("//"):
                missing.append(f"{proto.name}:{i + 1}: {stripped}")
    assert not missing, "fields without a comment:\n" + "\n".join(missing)
