"""The transport-free pipeline behind both fronts: n samples, the served model name, sampling defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.proto.meshserve.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from services.gateway.sampling_defaults import SamplingDefaults, load_sampling_defaults
from services.gateway.tokenizer import TextTokenizer
from tests.unit.gateway import build_tiny_model_dir
from tests.unit.gateway.fake_scheduler import FakeScheduler, running_gateway


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.from_dir(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _req(**fields: object) -> generation_pb2.GenerateRequest:
    sampling = fields.pop("sampling", sampling_pb2.SamplingParams(max_tokens=3))
    return generation_pb2.GenerateRequest(prompt="Hello world", sampling=sampling, **fields)  # type: ignore[arg-type]


async def test_n_samples_are_separate_submissions_with_seed_plus_index(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with running_gateway(tok, [fake]) as gateway, grpc.aio.insecure_channel(gateway.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = _req(n=3, sampling=sampling_pb2.SamplingParams(max_tokens=2, seed=2**64 - 2, temperature=0.7))
        responses = [r async for r in stub.Generate(request)]
        assert [s.sampling.seed for s in fake.submits] == [2**64 - 2, 2**64 - 1, 0]
        assert len({s.request_id for s in fake.submits}) == 3
        finals = [r for r in responses if r.finish_reason]
        assert sorted(r.index for r in finals) == [0, 1, 2]
        assert sum(1 for r in responses if r.request_id) == 1  # the id goes on the first message only

        complete = await stub.Complete(request)
        assert [c.index for c in complete.choices] == [0, 1, 2]
        assert all(c.token_ids == [100, 101] for c in complete.choices)
        assert complete.text == complete.choices[0].text
        assert complete.usage.completion_tokens == 6  # summed; the prompt counted once
        assert complete.usage.prompt_tokens == responses[-1].usage.prompt_tokens


async def test_n_out_of_range_is_invalid(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with running_gateway(tok, [fake]) as gateway, grpc.aio.insecure_channel(gateway.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for n in (0, 17):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Complete(_req(n=n))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in [1, 16]" in str(
                info.value.details()
            )
        assert fake.submits == []


async def test_a_model_other_than_the_served_one_is_not_found(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with running_gateway(tok, [fake]) as gateway, grpc.aio.insecure_channel(gateway.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert (await stub.Complete(_req(model="tiny"))).finish_reason  # what the workers report
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Complete(_req(model="gpt-4"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'tiny'" in str(info.value.details())
    async with running_gateway(tok, [FakeScheduler()], served_model_name=["smol", "alias"]) as gateway:
        assert gateway.pipeline.model_names() == ["smol", "alias"]
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            assert (await stub.Complete(_req(model="alias"))).finish_reason
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Complete(_req(model="tiny"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unset_sampling_fields_take_the_defaults(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, repetition_penalty=1.1)
    async with running_gateway(tok, [fake]) as gateway, grpc.aio.insecure_channel(gateway.address) as channel:
        gateway.pipeline.defaults = defaults
        stub = generation_pb2_grpc.GenerationStub(channel)
        await stub.Complete(_req())
        await stub.Complete(_req(sampling=sampling_pb2.SamplingParams(max_tokens=3, temperature=0, top_k=0)))
    first, second = (s.sampling for s in fake.submits)
    assert (round(first.temperature, 6), round(first.top_p, 6), first.top_k) == (0.2, 0.9, 40)
    assert round(first.repetition_penalty, 6) == 1.1
    assert (second.temperature, second.top_k, round(second.top_p, 6)) == (0, 0, 0.9)  # what was sent stays


def test_generation_config_defaults(tmp_path: Path) -> None:
    assert load_sampling_defaults(tmp_path) == SamplingDefaults()  # no file: vLLM's
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 512, "min_p": 7, "eos_token_id": 2}
        )
    )
    got = load_sampling_defaults(tmp_path)
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens, got.min_p) == (0.6, 0.95, 20, 512, 0.0)
    assert load_sampling_defaults(tmp_path, "vllm") == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text("{not json")
    assert load_sampling_defaults(tmp_path) == SamplingDefaults()


async def test_two_gateways_sharing_redis_hold_the_combined_rate(tok: TextTokenizer) -> None:
    import uuid

    import redis

    try:
        redis.Redis(host="127.0.0.1", port=6379, socket_timeout=0.5).ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    key = f"k-{uuid.uuid4().hex}"  # a fresh bucket: earlier runs' buckets live a minute in Redis
    shared: dict[str, Any] = {
        "api_key": [key],
        "rate_limit_requests_per_minute": 6,
        "redis": "redis://127.0.0.1:6379/15",
    }
    fake_a, fake_b = FakeScheduler(), FakeScheduler()
    metadata = (("authorization", f"Bearer {key}"),)
    async with running_gateway(tok, [fake_a], **shared) as a, running_gateway(tok, [fake_b], **shared) as b:
        codes: list[grpc.StatusCode] = []
        for i in range(16):
            address = (a, b)[i % 2].address
            async with grpc.aio.insecure_channel(address) as channel:
                try:
                    await generation_pb2_grpc.GenerationStub(channel).Complete(_req(), metadata=metadata)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code())
                    assert "per minute" in str(err.details())
    # GCRA allows a minute's budget at once: 6 in all, whichever replica took them.
    assert codes.count(grpc.StatusCode.OK) == 6
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 10
    assert len(fake_a.submits) + len(fake_b.submits) == 6 and fake_a.submits and fake_b.submits
