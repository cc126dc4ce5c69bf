"""The worker keeps freed host memory for reuse: a block freed and allocated again touches no new pages.

Each case runs in its own process (mallopt settings are process-wide) and counts the minor page faults of
allocating, filling and freeing 48 MiB tensors, one after another, and takes the median cycle. glibc maps
any block above 32 MiB (the most its self-tuning threshold reaches) and unmaps it when freed, so under its
defaults every cycle faults in all 12,288 pages again; that is the deterministic form of what a forward's
activations went through (docs/benchmarks.md, "A prefill step spent a third of its time faulting in pages").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.worker.host_allocator import is_glibc

ROOT = Path(__file__).resolve().parents[3]
PAGES_PER_BLOCK = (48 << 20) // 4096

_CYCLES = r"""
import json, resource, sys
import torch
from services.worker.host_allocator import retain_freed_memory

applied = retain_freed_memory() if sys.argv[1] == "retain" else False

def cycle() -> None:
    block = torch.empty(48 << 20, dtype=torch.uint8)
    block.fill_(1)
    del block

for _ in range(3):
    cycle()
per_cycle = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cycle()
    per_cycle.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The median, not the mean: the kernel may fault a kept block's pages in again now and then on its own
# (automatic NUMA balancing unmaps pages to sample their use; reclaim), which says nothing of the allocator.
faults = sorted(per_cycle)[len(per_cycle) // 2]
print(json.dumps({"applied": applied, "faults_per_cycle": faults, "per_cycle": per_cycle}))
"""

glibc_only = pytest.mark.skipif(not is_glibc(), reason="glibc's malloc")


def _cycle_faults(mode: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _CYCLES, mode],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc_only
def test_a_freed_block_is_reused_instead_of_faulted_in_again() -> None:
    plain = _cycle_faults("plain")
    retained = _cycle_faults("retain")
    assert retained["applied"] is True
    # Under glibc's defaults every cycle maps the block anew and faults in each of its pages.
    assert plain["faults_per_cycle"] >= PAGES_PER_BLOCK, plain
    # Kept, the block comes back from the heap with its pages already there.
    assert retained["faults_per_cycle"] < PAGES_PER_BLOCK / 10, (plain, retained)


@glibc_only
def test_a_malloc_setting_of_the_user_is_left_alone() -> None:
    # GLIBC_TUNABLES with a malloc setting: the user's choice wins, and mallopt is not called, so the block
    # is mapped anew every cycle as glibc does by default.
    result = _cycle_faults("retain", {"GLIBC_TUNABLES": "glibc.malloc.arena_test=8"})
    assert result["applied"] is False
    assert result["faults_per_cycle"] >= PAGES_PER_BLOCK, result
