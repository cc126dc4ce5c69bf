"""Rank 0's PipelineDriver against real stage processes (the worker's own spawner and follower loop): steps
overlap on the pipeline, answers come back in order with the right tokens, and a step that schedules a
request still on the pipeline is refused on every rank without stalling the others."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.ports import free_port
from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.worker.attach import StepRejected
from services.worker.distributed import DistInit
from services.worker.engine_config import EngineConfig
from services.worker.model_runner import ModelRunner
from services.worker.pipeline_driver import PipelineDriver
from services.worker.ranks import RankSpec, spawn_local_ranks
from tests.support.tiny_model import make_tiny_model, transformers_greedy

GREEDY = sampling_pb2.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pipeline-driver"), num_layers=4)


@pytest.fixture
def driver(model_dir: Path) -> Iterator[PipelineDriver]:
    config = EngineConfig(model_path=str(model_dir), device="cpu", precision="fp32-fp32-fp32",
                          pipeline_parallel_size=2, kv_cache_memory_bytes=8 << 20, max_model_len=128)  # fmt: skip
    dist = DistInit(rank=0, world_size=2, local_rank=0, init_method=f"tcp://127.0.0.1:{free_port()}")
    processes = spawn_local_ranks(RankSpec(config, dist, 2, "off", "warning", "json"), first_rank=0)
    pipeline = PipelineDriver(ModelRunner(config, dist), processes, threading.Event())
    try:
        yield pipeline
    finally:
        pipeline.close()


def _new(rid: str, prompt: list[int], first_block: int) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY,
                                 block_ids=list(range(first_block, first_block + 4)), num_computed_tokens=0,
                                 num_scheduled_tokens=len(prompt))  # fmt: skip


def _decode(step_id: int, rid: str, num_computed: int) -> worker_pb2.Step:
    scheduled = worker_pb2.ScheduledRequest(request_id=rid, num_computed_tokens=num_computed, num_scheduled_tokens=1)
    return worker_pb2.Step(step_id=step_id, scheduled=[scheduled])


def test_two_micro_batches_on_the_pipeline_decode_like_transformers(driver: PipelineDriver, model_dir: Path) -> None:
    prompts = {"a": list(range(20, 40)), "b": [5, 6, 7, 8, 9, 10, 11]}
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    # Both prefills are launched before either is answered: each stage works on one of them.
    futures = {
        "a": driver.launch(worker_pb2.Step(step_id=1, new_requests=[_new("a", prompts["a"], 0)])),
        "b": driver.launch(worker_pb2.Step(step_id=2, new_requests=[_new("b", prompts["b"], 4)])),
    }
    step_id = 3
    for _ in range(8):
        for rid in ("a", "b"):
            result = futures[rid].result(timeout=60)
            assert not result.error and [t.request_id for t in result.sampled] == [rid]
            tokens[rid].append(result.sampled[0].token_id)
            futures[rid] = driver.launch(_decode(step_id, rid, len(prompts[rid]) + len(tokens[rid]) - 1))
            step_id += 1
    for rid in ("a", "b"):
        tokens[rid].append(futures[rid].result(timeout=60).sampled[0].token_id)
        assert tokens[rid] == transformers_greedy(model_dir, prompts[rid], 9)


def test_a_request_still_on_the_pipeline_is_refused_and_the_pipeline_goes_on(driver: PipelineDriver) -> None:
    prompt = list(range(30, 45))
    # The answer thread books step 1's answer under the driver's lock. Held here (made reentrant, so this
    # thread's launches still take it) until the second launch is refused, the answer cannot be booked in
    # between: on a loaded machine it otherwise could, and "a" would no longer be on the pipeline.
    driver._lock = threading.RLock()  # type: ignore[assignment]
    with driver._lock:
        first = driver.launch(worker_pb2.Step(step_id=1, new_requests=[_new("a", prompt, 0)]))
        # A scheduler that broke the micro-batch rule: "a" is scheduled again before its prefill answered.
        with pytest.raises(StepRejected, match="is still in step 1 on the pipeline") as info:
            driver.launch(_decode(2, "a", len(prompt)))
    assert info.value.request_id == "a"
    answer = first.result(timeout=60)
    assert not answer.error and len(answer.sampled) == 1
    # Once answered, "a" decodes on every stage: the refusal left no rank behind.
    second = driver.launch(_decode(3, "a", len(prompt))).result(timeout=60)
    assert not second.error and len(second.sampled) == 1
