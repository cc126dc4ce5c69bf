"""The whole suite on a tiny random Llama, over real gRPC between real processes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.channels import insecure_channel
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.gateway.raw_request import encode_raw_request
from tests.support.calls import expect_invalid, greedy_token_answers, stream
from tests.support.scrape import scrape_metrics
from tests.support.suite import Suite, start_suite
from tests.support.tiny_model import transformers_greedy

VOCAB = 512


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 90, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(10, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def test_concurrent_greedy_matches_transformers(tiny_suite: Suite, tiny_model_dir: Path) -> None:
    prompts = _prompts(10, seed=1)
    answers = await greedy_token_answers(tiny_suite.address, prompts, max_tokens=24)
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.token_ids == transformers_greedy(tiny_model_dir, prompt, 24)
        assert answer.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == len(prompt)
        assert answer.usage.completion_tokens == 24


async def test_shared_prefix_hits_cache_and_matches(tiny_suite: Suite, tiny_model_dir: Path) -> None:
    prefix = _prompts(1, seed=2, lo=200, hi=200)[0]
    prompts = _prompts(8, seed=3, lo=5, hi=40, prefix=prefix)
    before = await tiny_suite.stats()
    first = await greedy_token_answers(tiny_suite.address, prompts[:1], max_tokens=16)
    rest = await greedy_token_answers(tiny_suite.address, prompts[1:], max_tokens=16)
    after = await tiny_suite.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 7 * 192
    for prompt, answer in zip(prompts, first + rest, strict=True):
        assert answer.token_ids == transformers_greedy(tiny_model_dir, prompt, 16)
    assert all(a.usage is not None and a.usage.cached_tokens >= 192 for a in rest)


async def test_batching_mixes_prefill_and_decode(tiny_suite: Suite) -> None:
    before = await tiny_suite.stats()
    params = sampling_params(max_tokens=64, temperature=0.0, ignore_eos=True)
    async with GenerationClient(tiny_suite.address) as client:
        long_running = asyncio.create_task(stream(client, build_request(token_ids=[11, 12, 13], sampling=params)))
        await asyncio.sleep(0.3)
        late = [
            asyncio.create_task(stream(client, build_request(token_ids=p, sampling=params)))
            for p in _prompts(6, seed=4, lo=40, hi=80)
        ]
        await asyncio.gather(long_running, *late)
    after = await tiny_suite.stats()
    assert after.num_mixed_steps > before.num_mixed_steps, "no step held both prefill and decode tokens"
    assert after.max_batch_size > 1


async def test_cancel_frees_all_blocks(tiny_suite: Suite) -> None:
    params = sampling_params(max_tokens=400, temperature=0.0, ignore_eos=True)
    async with GenerationClient(tiny_suite.address) as client:
        call = client.stub.Generate(build_request(token_ids=list(range(20, 120)), sampling=params))
        received = 0
        async for _ in call:
            received += 1
            if received == 3:
                break
        call.cancel()
    stats = await tiny_suite.wait_idle()
    for worker in stats.workers:
        assert worker.num_free_blocks == worker.num_blocks
        assert worker.num_running == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"token_ids": []}, "token_ids.ids"),
        ({"token_ids": [1] * 1100}, "token_ids.ids"),
        ({"token_ids": [1, 2, VOCAB]}, "token_ids.ids[2]"),
        ({"token_ids": [1, -1]}, "token_ids.ids[1]"),
        ({"prompt": "hi", "sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
        ({"prompt": "hi", "sampling": {"temperature": -0.5}}, "sampling.temperature"),
        ({"prompt": "hi", "sampling": {"top_p": 0.0}}, "sampling.top_p"),
        ({"prompt": "hi", "sampling": {"top_p": 1.5}}, "sampling.top_p"),
        ({"prompt": "hi", "sampling": {"stop_token_ids": [VOCAB + 3]}}, "sampling.stop_token_ids[0]"),
    ],
)
async def test_bad_input_is_invalid_argument(tiny_suite: Suite, kwargs: dict, field: str) -> None:
    sampling = sampling_params(**kwargs.pop("sampling", {}))
    async with GenerationClient(tiny_suite.address) as client:
        assert await expect_invalid(client, build_request(sampling=sampling, **kwargs)) == [field]
        ok = await stream(client, build_request(prompt="still serving", sampling=sampling_params(max_tokens=2)))
        assert ok.usage is not None and ok.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("fields", "bad_field"),
    [
        ({"prompt": b"caf\xc3"}, "prompt"),
        (
            {"chat": {"messages": [{"role": "user", "content": b"ok"}, {"role": "user", "content": b"\xff"}]}},
            "chat.messages[1].content",
        ),
        ({"prompt": b"fine", "sampling": {"stop": [b"\xfe\xfe"]}}, "sampling.stop[0]"),
    ],
)
async def test_invalid_utf8_is_invalid_argument(tiny_suite: Suite, fields: dict, bad_field: str) -> None:
    payload = encode_raw_request(**fields)
    async with insecure_channel(tiny_suite.address) as channel:
        generate = channel.unary_stream(
            "/meshserve.v1.Generation/Generate",
            request_serializer=lambda b: b,
            response_deserializer=generation_pb2.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in generate(payload):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_field in (info.value.details() or "")


async def test_seeded_sampling_is_reproducible(tiny_suite: Suite) -> None:
    def request(seed: int) -> generation_pb2.GenerateRequest:
        params = sampling_params(max_tokens=20, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
        return build_request(prompt="Once upon a time", sampling=params)

    async with GenerationClient(tiny_suite.address) as client:
        a, b, c = await asyncio.gather(
            stream(client, request(7)), stream(client, request(7)), stream(client, request(8))
        )
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert a.token_ids != c.token_ids


async def test_text_prompt_stop_string_and_complete(tiny_suite: Suite) -> None:
    params = sampling_params(max_tokens=30, temperature=0.0, ignore_eos=True)
    async with GenerationClient(tiny_suite.address) as client:
        full = await client.complete(build_request(prompt="The quick brown fox", sampling=params))
        assert full.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert len(full.token_ids) == 30
        streamed = await stream(client, build_request(prompt="The quick brown fox", sampling=params))
        assert streamed.text == full.text
        # Cut at a stop string taken from the middle of the greedy answer.
        text = full.text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if stop.strip():
            stop_params = sampling_params(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
            cut = await stream(client, build_request(prompt="The quick brown fox", sampling=stop_params))
            assert cut.finish_reason == sampling_pb2.FINISH_REASON_STOP
            assert cut.stop_reason == stop
            assert cut.text == text[: text.index(stop)]
            assert len(cut.token_ids) < 30
    await tiny_suite.wait_idle()


async def test_stop_token_id_ends_request(tiny_suite: Suite, tiny_model_dir: Path) -> None:
    prompt = _prompts(1, seed=9)[0]
    expected = transformers_greedy(tiny_model_dir, prompt, 12)
    stop_id = expected[5]
    answers = await greedy_token_answers(tiny_suite.address, [prompt], max_tokens=12, stop_token_ids=[stop_id])
    answer = answers[0]
    assert answer.token_ids == expected[: expected.index(stop_id) + 1]
    assert answer.finish_reason == sampling_pb2.FINISH_REASON_STOP
    assert answer.stop_reason == str(stop_id)


async def test_health_reflection_and_request_id(tiny_suite: Suite) -> None:
    for service in (tiny_suite.gateway, tiny_suite.scheduler, *tiny_suite.workers):
        async with insecure_channel(service.address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service.name
    sync_channel = grpc.insecure_channel(tiny_suite.address)
    try:
        names = ProtoReflectionDescriptorDatabase(sync_channel).get_services()
    finally:
        sync_channel.close()
    assert "meshserve.v1.Generation" in names
    async with GenerationClient(tiny_suite.address) as client:
        call = client.stub.Generate(
            build_request(prompt="trace me", sampling=sampling_params(max_tokens=2)),
            metadata=(("x-request-id", "trace-abc-123"),),
        )
        async for _ in call:
            pass
    # The client's id is logged beside the gateway's own id, which every hop's logs carry.
    tagged = [r for r in tiny_suite.log_records("gateway") if r.get("client_request_id") == "trace-abc-123"]
    internal = {r["request_id"] for r in tagged}
    assert len(internal) == 1 and "trace-abc-123" not in internal
    assert any(r.get("request_id") in internal for r in tiny_suite.log_records("scheduler"))


@pytest.mark.parametrize("scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_preemption_keeps_greedy_outputs(tiny_model_dir: Path, tmp_path: Path, scheduling: str) -> None:
    # 20 blocks of 16 tokens (fp32, 2 layers, 2 KV heads of 16): far less than 8 requests need at once.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    metrics_port = free_port()
    suite = start_suite(
        tiny_model_dir,
        tmp_path,
        worker_args=["--kv-cache-memory", str(20 * block_bytes), "--max-model-len", "320"],
        scheduler_args=["--max-num-batched-tokens", "128", "--metrics-port", str(metrics_port), scheduling],
    )
    try:
        prompts = _prompts(8, seed=5, lo=30, hi=80)
        answers = asyncio.run(greedy_token_answers(suite.address, prompts, max_tokens=40))
        stats = asyncio.run(suite.wait_idle())
        metrics = scrape_metrics(metrics_port)
    finally:
        suite.stop()
    assert stats.num_preemptions > 0, "the KV cache was not small enough to force preemption"
    labels = f'{{model_name="{tiny_model_dir.name}"}}'
    assert f"meshserve:num_preemptions_total{labels} {float(stats.num_preemptions)}" in metrics
    assert f"meshserve:prefix_cache_queries_total{labels} {float(stats.prefix_cache_queries)}" in metrics
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.token_ids == transformers_greedy(tiny_model_dir, prompt, 40)


def test_sigterm_lets_streams_finish(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A grace period far above the stream's ~10 s, so a slow or busy machine cannot cut it short.
    suite = start_suite(
        tiny_model_dir,
        tmp_path,
        worker_args=["--kv-cache-memory", "16MiB"],
        gateway_args=["--shutdown-grace-period", "120"],
    )
    try:

        async def run() -> None:
            params = sampling_params(max_tokens=1000, temperature=0.0, ignore_eos=True)
            tokens, finish, signalled = 0, 0, False
            async with GenerationClient(suite.address) as client:
                async for response in client.generate(build_request(token_ids=[5, 6, 7], sampling=params)):
                    tokens += len(response.token_ids)
                    finish = response.finish_reason
                    # A message may carry several tokens (a call that fell behind gets them merged).
                    if tokens >= 3 and not signalled:
                        signalled = True
                        os.kill(suite.gateway.process.pid, signal.SIGTERM)
                        await asyncio.sleep(0.2)
                        async with insecure_channel(suite.address) as channel:
                            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert finish == sampling_pb2.FINISH_REASON_LENGTH
            assert tokens == 1000

        asyncio.run(run())
        assert suite.gateway.process.wait(150) == 0
    finally:
        suite.stop()
    for service in (suite.scheduler, *suite.workers):
        assert service.process.returncode == 0, service.log_tail()


def test_lost_worker_requests_finish_on_another(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = start_suite(tiny_model_dir, tmp_path, num_workers=2, worker_args=["--kv-cache-memory", "16MiB"])
    prompts = _prompts(8, seed=11, lo=5, hi=40)
    try:

        async def run() -> list:
            params = sampling_params(max_tokens=300, temperature=0.0, ignore_eos=True)
            async with GenerationClient(suite.address) as client:
                tasks = [
                    asyncio.create_task(stream(client, build_request(token_ids=p, sampling=params))) for p in prompts
                ]
                await suite.wait_running("worker-0")
                victim = suite.workers[0].process
                victim.kill()
                victim.wait()
                return list(await asyncio.gather(*tasks))

        answers = asyncio.run(run())
        stats = asyncio.run(suite.wait_idle())
    finally:
        suite.stop()
    assert [w.worker_id for w in stats.workers] == ["worker-1"]
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert answer.token_ids == transformers_greedy(tiny_model_dir, prompt, 300)
