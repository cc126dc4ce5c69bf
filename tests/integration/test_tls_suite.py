"""A whole suite (kvstore, scheduler, two workers, gateway) with mTLS and the internal token on every hop,
over real processes: requests are served end to end through TLS, every internal port refuses a client
without a certificate of the CA, and a client with a certificate but without the token gets UNAUTHENTICATED
(health and reflection stay open)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.client.client import GenerationClient, build_request, sampling_params
from services.client.dev_certs import DevCerts, make_dev_certs
from services.common.channels import open_channel
from services.common.internal_auth import REFUSED
from services.common.proto.meshserve.v1 import (
    kvstore_pb2,
    kvstore_pb2_grpc,
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
)
from services.common.tls import Security, load_files
from tests.support.calls import Answer, stream
from tests.support.suite import Suite, start_suite

pytestmark = pytest.mark.slow

VOCAB = 512
BLOCK = 16
TOKEN = "tls-suite-token-6f1d2c9a8b7e4f3a"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    return make_dev_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_suite(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, certs: DevCerts) -> Iterator[Suite]:
    """mTLS with per-service certificates and the internal token on all five processes."""
    token_file = tmp_path_factory.mktemp("token") / "internal-token"
    token_file.write_text(TOKEN + "\n")
    suite = start_suite(
        tiny_model_dir,
        tmp_path_factory.mktemp("tls-logs"),
        num_workers=2,
        worker_args=["--kv-cache-memory", "16MiB"],
        scheduler_args=["--routing", "round-robin"],
        kv_store_args=[],
        common_args=["--internal-token-file", str(token_file)],
        certs=certs,
    )
    yield suite
    suite.stop()


def _client(certs: DevCerts, *, token: str | None = TOKEN, name: str = "client") -> Security:
    """A peer presenting `name`'s certificate, with or without the token."""
    pair = certs.pair(name)
    return Security(ca=certs.ca.read_bytes(), cert=pair.cert.read_bytes(), key=pair.key.read_bytes(), token=token)


def _kv_store(suite: Suite) -> str:
    assert suite.kv_store is not None
    return suite.kv_store.address


async def _scheduler_stats(suite: Suite, security: Security) -> scheduler_pb2.SchedulerStats:
    async with open_channel(suite.scheduler.address, security) as channel:
        stats: scheduler_pb2.SchedulerStats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10
        )
        return stats


async def _store_stats(suite: Suite, security: Security | None) -> kvstore_pb2.StoreStats:
    async with open_channel(_kv_store(suite), security) as channel:
        stats: kvstore_pb2.StoreStats = await kvstore_pb2_grpc.KVBlockStoreStub(channel).Stats(
            kvstore_pb2.StatsRequest(), timeout=10
        )
        return stats


async def _model_info(suite: Suite, security: Security | None) -> scheduler_pb2.ModelInfo:
    async with open_channel(suite.scheduler.address, security) as channel:
        info: scheduler_pb2.ModelInfo = await scheduler_pb2_grpc.SchedulerStub(channel).GetModelInfo(
            scheduler_pb2.GetModelInfoRequest(), timeout=5
        )
        return info


async def _health(address: str, security: Security | None) -> int:
    async with open_channel(address, security) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def _greedy(suite: Suite, security: Security, prompt: list[int], max_tokens: int) -> Answer:
    params = sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with GenerationClient(suite.address, security) as client:
        return await stream(client, build_request(token_ids=prompt, sampling=params))


async def _wait_stored(suite: Suite, security: Security, num_blocks: int, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (await _store_stats(suite, security)).blocks_stored < num_blocks:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the store never held {num_blocks} blocks")
        await asyncio.sleep(0.05)


def test_greedy_requests_cross_every_hop_over_mtls(tls_suite: Suite, certs: DevCerts) -> None:
    """gateway -> scheduler, worker -> scheduler (Attach), scheduler -> kvstore (Lookup), worker -> kvstore (Put
    on worker-0, Get on worker-1): the same prompt on one worker, then loaded from the store on the other."""
    prompt = [random.Random(1).randrange(10, VOCAB) for _ in range(120)]
    # The public port: TLS that trusts the CA; the gateway asks for no client certificate or token.
    public = load_files(ca=str(certs.ca))

    async def run() -> tuple[Answer, Answer, scheduler_pb2.SchedulerStats, kvstore_pb2.StoreStats]:
        first = await _greedy(tls_suite, public, prompt, 16)
        await _wait_stored(tls_suite, _client(certs), (len(prompt) - 1) // BLOCK)
        second = await _greedy(tls_suite, public, prompt, 16)
        stats = await _scheduler_stats(tls_suite, _client(certs))
        return first, second, stats, await _store_stats(tls_suite, _client(certs))

    first, second, stats, store = asyncio.run(run())
    assert first.finish_reason == second.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert len(first.token_ids) == 16 and second.token_ids == first.token_ids
    workers = {w.worker_id: w for w in stats.workers}
    assert workers["worker-0"].num_routed == 1 and workers["worker-1"].num_routed == 1
    num_blocks = (len(prompt) - 1) // BLOCK
    assert workers["worker-0"].kv_store_saves >= num_blocks and workers["worker-0"].kv_store_saves_dropped == 0
    assert workers["worker-1"].kv_store_loaded_tokens == num_blocks * BLOCK
    assert stats.kv_store_lookups >= 2 and stats.kv_store_lookup_errors == 0
    assert store.blocks_stored >= num_blocks and store.hits >= num_blocks
    assert second.usage is not None and second.usage.cached_tokens == num_blocks * BLOCK


def test_gateway_serves_tls_only(tls_suite: Suite) -> None:
    async def run() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _health(tls_suite.address, None)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())


def test_internal_ports_refuse_peers_without_a_certificate_of_the_ca(tls_suite: Suite, certs: DevCerts) -> None:
    other = make_dev_certs(Path(tls_suite.log_dir) / "other-ca", names=("client",))
    no_cert = load_files(ca=str(certs.ca))
    foreign_cert = Security(
        ca=certs.ca.read_bytes(),
        cert=other.pair("client").cert.read_bytes(),
        key=other.pair("client").key.read_bytes(),
        token=TOKEN,
    )
    internal = [tls_suite.scheduler.address, _kv_store(tls_suite), *(w.address for w in tls_suite.workers)]

    async def refused(address: str, security: Security | None) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _health(address, security)
        return err.value.code()

    async def run() -> None:
        for address in internal:
            assert await refused(address, no_cert) == grpc.StatusCode.UNAVAILABLE, address
            assert await refused(address, None) == grpc.StatusCode.UNAVAILABLE, address
            assert await refused(address, foreign_cert) == grpc.StatusCode.UNAVAILABLE, address
            assert await _health(address, _client(certs)) == health_pb2.HealthCheckResponse.SERVING, address
        # The token alone does not get past the handshake either.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _model_info(tls_suite, Security(ca=certs.ca.read_bytes(), token=TOKEN))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Every service's certificate is a valid client certificate (each is what it presents on its own hops).
        for name in ("client", "gateway", "worker", "scheduler"):
            info = await _model_info(tls_suite, _client(certs, name=name))
            assert info.num_ready_workers == 2 and info.accepting
        stats = await _store_stats(tls_suite, _client(certs, name="worker"))
        assert stats.backend == "memory"

    asyncio.run(run())


async def _nothing() -> AsyncIterator[worker_pb2.WorkerMessage]:
    return
    yield  # an async generator that sends nothing


def test_internal_apis_need_the_token_but_health_and_reflection_do_not(tls_suite: Suite, certs: DevCerts) -> None:
    without = _client(certs, token=None)
    wrong = _client(certs, token=TOKEN[:-4] + "0000")

    async def unauthenticated(call: object) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if hasattr(call, "__aiter__"):
                [m async for m in call]  # type: ignore[attr-defined]
            else:
                await call  # type: ignore[misc]
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        details = err.value.details() or ""
        assert details == REFUSED and TOKEN not in details and TOKEN[:8] not in details

    async def run() -> None:
        for security in (without, wrong):
            async with open_channel(tls_suite.scheduler.address, security) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                await unauthenticated(stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest(), timeout=5))
                await unauthenticated(stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5))
                # A worker without the token cannot attach, whatever certificate it has.
                await unauthenticated(stub.Attach(_nothing(), timeout=5))
            async with open_channel(_kv_store(tls_suite), security) as channel:
                kv = kvstore_pb2_grpc.KVBlockStoreStub(channel)
                await unauthenticated(kv.Stats(kvstore_pb2.StatsRequest(), timeout=5))
                request = kvstore_pb2.GetRequest(kv_format="x", block_hashes=[b"\0" * 32])
                await unauthenticated(kv.Get(request, timeout=5))
                await unauthenticated(kv.Lookup(kvstore_pb2.LookupRequest(kv_format="x"), timeout=5))
            # Health and reflection answer with a certificate and no token.
            for address in (tls_suite.scheduler.address, _kv_store(tls_suite)):
                assert await _health(address, security) == health_pb2.HealthCheckResponse.SERVING
                async with open_channel(address, security) as channel:
                    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
                    call = reflection.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                    )
                    names = [s.name async for r in call for s in r.list_services_response.service]
                    assert "grpc.health.v1.Health" in names
        # With the token: OK.
        assert (await _model_info(tls_suite, _client(certs))).num_ready_workers == 2
        assert (await _store_stats(tls_suite, _client(certs))).backend == "memory"

    asyncio.run(run())
    # The services logged refusals, and never the token.
    logs = "".join((tls_suite.log_dir / f"{name}.log").read_text() for name in ("scheduler", "kvstore"))
    assert "internal call refused" in logs
    for path in tls_suite.log_dir.glob("*.log"):
        assert TOKEN not in path.read_text(), path.name
