"""The worker keeps freed host memory for the next step: warm prefill steps touch no new pages.

Each case runs in its own process (mallopt settings are process-wide) and counts the minor page faults of
warm prefill steps of a real ModelRunner, wide enough that its activations are blocks glibc would otherwise
map and unmap every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[3]

_STEPS = r"""
import json, resource, sys
from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.worker.engine_config import EngineConfig
from services.worker.host_allocator import retain_freed_memory
from services.worker.model_runner import ModelRunner

retain = sys.argv[2] == "retain"
applied = retain_freed_memory() if retain else False
tokens, blocks_per = 1024, 1024 // 16 + 1
runner = ModelRunner(EngineConfig(model_path=sys.argv[1], dtype="float32", block_size=16,
    kv_cache_memory_bytes=64 << 20, max_model_len=1100, max_num_batched_tokens=tokens, max_num_seqs=4))

def prefill(step_id: int) -> None:
    # The previous step's request leaves as this one comes in.
    step = worker_pb2.Step(step_id=step_id, removed_request_ids=[f"r{step_id - 1}"] if step_id else [])
    # Alternate two block ranges: each step is a new request over blocks no running request holds.
    first = (step_id % 2) * blocks_per
    step.new_requests.append(worker_pb2.NewRequest(request_id=f"r{step_id}",
        prompt_token_ids=[(7 * j + step_id) % 500 + 1 for j in range(tokens)],
        sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=1),
        block_ids=list(range(first, first + blocks_per)), num_scheduled_tokens=tokens))
    result = runner.execute(step)
    assert not result.error, result.error

for s in range(3):
    prefill(s)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for s in range(3, 8):
    prefill(s)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
print(json.dumps({"applied": applied, "faults_per_step": faults}))
"""


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 512: a 1,024-token step's gate/up output is 4 MiB in fp32, far above glibc's first mmap threshold;
    # 6 layers: enough freed blocks that glibc's defaults trim the heap and map new pages every step (with 2,
    # a step's blocks fit under the thresholds glibc raises by itself).
    return make_tiny_model(
        tmp_path_factory.mktemp("wide"),
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=2048,
    )


def _warm_step_faults(model: Path, mode: str, env: dict[str, str] | None = None) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, str(model), mode],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "confstr") or sys.platform != "linux", reason="glibc's malloc")
def test_warm_steps_reuse_freed_memory_instead_of_faulting_in_new_pages(wide_model: Path) -> None:
    retained = _warm_step_faults(wide_model, "retain")
    plain = _warm_step_faults(wide_model, "plain")
    assert retained["applied"] is True
    # Kept, a warm step touches almost no page anew (measured: 1-2 a step).
    assert retained["faults_per_step"] < 100, retained
    # The same steps under glibc's defaults fault their activations in again, step after step.
    assert plain["faults_per_step"] > 1000, (plain, retained)


def test_a_malloc_setting_of_the_user_is_left_alone(wide_model: Path) -> None:
    # GLIBC_TUNABLES with a malloc setting: the user's choice wins, and mallopt is not called.
    result = _warm_step_faults(wide_model, "retain", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"})
    assert result["applied"] is False
