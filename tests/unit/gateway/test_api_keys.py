"""API keys on the public gRPC API: missing or wrong keys are UNAUTHENTICATED, health stays open."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import StatusError
from services.common.proto.meshserve.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from services.gateway.api_keys import ApiKeys, key_id, read_key_file
from services.gateway.tokenizer import TextTokenizer
from tests.unit.gateway import build_tiny_model_dir
from tests.unit.gateway.fake_scheduler import FakeScheduler, running_gateway


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.from_dir(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_check_accepts_only_configured_keys() -> None:
    keys = ApiKeys(["alpha", "beta"])
    assert keys.check("Bearer beta") == key_id("beta") and keys.check("bearer alpha") == key_id("alpha")
    for bad in (None, "", "beta", "Bearer gamma", "Basic YWxwaGE=", "Bearer " + "x" * 5000):
        with pytest.raises(StatusError) as info:
            keys.check(bad)
        assert info.value.status.code == grpc.StatusCode.UNAUTHENTICATED
        assert "alpha" not in info.value.status.details and "beta" not in info.value.status.details
    assert ApiKeys([]).check(None) is None  # keys off: open


def test_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nk1\n\n  k2  \n")
    assert read_key_file(path) == ["k1", "k2"]


async def test_grpc_calls_need_a_key_and_health_does_not(tok: TextTokenizer, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("from-file\n")
    fake = FakeScheduler()
    request = generation_pb2.GenerateRequest(prompt="Hello", sampling=sampling_pb2.SamplingParams(max_tokens=2))
    async with (
        running_gateway(tok, [fake], api_key=["s3cret"], api_key_file=str(key_file)) as gateway,
        grpc.aio.insecure_channel(gateway.address) as channel,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Complete(request, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert fake.submits == []
        for key in ("s3cret", "from-file"):
            done = await stub.Complete(request, metadata=(("authorization", f"Bearer {key}"),))
            assert done.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
