"""`meshserve kvstore` as real processes, on the memory backend and on private redis-servers."""

from __future__ import annotations

import asyncio
import signal
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.client.launcher import Launcher, ServiceProcess
from services.common.byte_sizes import parse_size
from services.common.errors import field_violations
from services.common.kv_store_limits import MAX_BLOCK_HASHES, MAX_CHUNK_BYTES
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import kvstore_pb2
from services.kvstore.backend import block_key
from services.kvstore.block_format import PAYLOAD_LENGTH_OFFSET, BlockShape, encode
from services.kvstore.health import BACKEND_HEALTH_NAME, SERVICE_NAME
from services.kvstore.validation import shape_to_proto
from tests.support.kvstore import (
    BIG,
    SMALL,
    TEST_STORE_CAPACITY,
    KVStoreClient,
    RedisServer,
    Slice,
    block_hashes,
    held_back,
    kv_format,
    kvstore_launcher,
    launch_kvstore,
    payload,
    start_kvstore,
)
from tests.support.scrape import scrape_metrics

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvstore")


@pytest.fixture(scope="module")
def launcher(log_dir: Path) -> Iterator[Launcher]:
    launcher = kvstore_launcher(log_dir)
    yield launcher
    launcher.stop_all(timeout=10)


@pytest.fixture(scope="module")
def shared_redis(log_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(log_dir)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def memory_store(launcher: Launcher) -> ServiceProcess:
    return start_kvstore(launcher, "kvstore-memory")


@pytest.fixture(scope="module")
def redis_store(launcher: Launcher, shared_redis: RedisServer) -> ServiceProcess:
    return start_kvstore(launcher, "kvstore-redis", shared_redis.url)


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> ServiceProcess:
    """Each backend in turn."""
    service: ServiceProcess = request.getfixturevalue(f"{request.param}_store")
    return service


def _slices(
    fmt: str, shape: BlockShape, n: int, seed: int = 0, head_start: int = 0, head_count: int = 0
) -> list[Slice]:
    return [
        Slice(fmt, h, shape, payload(shape, seed + i), head_start, head_count)
        for i, h in enumerate(block_hashes(fmt, n))
    ]


def _heads(data: bytes, shape: BlockShape, start: int, count: int) -> bytes:
    per_head = shape.bytes_per_head
    return data[start * per_head : (start + count) * per_head]


async def test_round_trip_whole_and_by_head_range(store: ServiceProcess) -> None:
    fmt = kv_format(f"round-trip-{store.name}")
    slices = _slices(fmt, BIG, 3)
    hashes = [s.block_hash for s in slices]
    async with KVStoreClient(store.address) as kv:
        before = await kv.stats()
        put = await kv.put(slices)
        assert (put.num_blocks_stored, put.num_blocks_existing, put.num_blocks_dropped, put.num_slices_pending) == (
            3, 0, 0, 0,
        )  # fmt: skip
        assert await kv.lookup(fmt, hashes) == 3

        whole = await kv.get(fmt, hashes)
        assert [b.data for b in whole] == [s.data for s in slices]
        for i, block in enumerate(whole):
            assert (block.header.index, block.header.block_hash) == (i, hashes[i])
            assert (block.header.head_start, block.header.head_count) == (0, 4)
            assert block.header.shape == shape_to_proto(BIG)
        middle = await kv.get(fmt, hashes, head_start=1, head_count=2)
        assert [b.data for b in middle] == [_heads(s.data, BIG, 1, 2) for s in slices]
        rest = await kv.get(fmt, hashes, head_start=3)  # head_count 0: every head from head_start on
        assert [(b.header.head_count, b.data) for b in rest] == [(1, _heads(s.data, BIG, 3, 1)) for s in slices]

        # A chain is only useful from its start: counting and reading stop at the first miss.
        missing = block_hashes("never stored", 1)[0]
        assert await kv.lookup(fmt, [hashes[0], missing, hashes[2]]) == 1
        assert len(await kv.get(fmt, [hashes[0], missing, hashes[2]])) == 1
        assert await kv.lookup(fmt, [missing, *hashes]) == 0
        assert await kv.lookup(kv_format("another format"), hashes) == 0

        # Stored once; chunked differently, the same blocks are found, not rewritten.
        again = await kv.put(slices, chunk_bytes=100_000)
        assert (again.num_blocks_stored, again.num_blocks_existing) == (0, 3)

        after = await kv.stats()
        assert after.backend == store.name.removeprefix("kvstore-")
        assert after.backend_serving
        if after.backend == "memory":  # Redis keeps its own counts (and maxmemory decides its room)
            assert after.capacity_bytes == parse_size(TEST_STORE_CAPACITY[1])
            assert after.num_blocks - before.num_blocks == 3
            assert after.bytes_used - before.bytes_used > 3 * BIG.payload_bytes
        else:
            assert (after.capacity_bytes, after.num_blocks, after.bytes_used) == (0, 0, 0)
        assert after.blocks_stored - before.blocks_stored == 3
        assert after.bytes_in - before.bytes_in == 6 * BIG.payload_bytes
        assert after.bytes_out - before.bytes_out == 4 * BIG.payload_bytes + 3 * 3 * BIG.bytes_per_head
        # Lookups: 3 + 1 + 0 + 0 hits; gets: 3 + 3 + 3 + 1.
        assert after.hits - before.hits == 14
        assert after.misses - before.misses == 2 + 4 + 3 + 2


async def test_tensor_parallel_slices_from_two_streams(store: ServiceProcess) -> None:
    fmt = kv_format(f"tp-{store.name}")
    rank0 = _slices(fmt, BIG, 3, head_start=0, head_count=2)
    rank1 = _slices(fmt, BIG, 3, head_start=2, head_count=2)
    hashes = [s.block_hash for s in rank0]
    async with KVStoreClient(store.address) as kv:
        first = await kv.put(rank0)
        assert (first.num_blocks_stored, first.num_slices_pending) == (0, 3)
        assert await kv.lookup(fmt, hashes) == 0
        assert (await kv.stats()).num_pending_slices >= 3
        second = await kv.put(rank1)
        assert (second.num_blocks_stored, second.num_slices_pending) == (3, 0)
        assert [b.data for b in await kv.get(fmt, hashes)] == [s.data for s in rank0]
        assert [b.data for b in await kv.get(fmt, hashes, 2, 2)] == [_heads(s.data, BIG, 2, 2) for s in rank0]

        # Both ranks at once, their chunks interleaved: each block is stored exactly once.
        both = [_slices(fmt, BIG, 6, head_start=2 * rank, head_count=2)[3:] for rank in range(2)]
        outcomes = await asyncio.gather(*(kv.put(slices) for slices in both))
        assert sum(o.num_blocks_stored for o in outcomes) == 3
        later = [s.block_hash for s in both[0]]
        assert [b.data for b in await kv.get(fmt, later)] == [s.data for s in both[0]]
        assert (await kv.stats()).num_pending_slices == 0


def _with_payload_length(value: bytes, length: int) -> bytes:
    field = slice(PAYLOAD_LENGTH_OFFSET, PAYLOAD_LENGTH_OFFSET + 8)
    return value[: field.start] + struct.pack("<Q", length) + value[field.stop :]


@pytest.mark.parametrize(
    ("reason", "corrupt"),
    [
        ("checksum", lambda value, other: value[:-7] + bytes([value[-7] ^ 0x20]) + value[-6:]),
        ("truncated", lambda value, other: value[: len(value) // 2]),
        ("length", lambda value, other: _with_payload_length(value, 99)),
        ("hash", lambda value, other: other),
        ("magic", lambda value, other: b"not a block at all"),
        ("format", None),
    ],
)  # fmt: skip
async def test_corrupt_stored_values_are_rejected_deleted_and_counted(
    redis_store: ServiceProcess,
    shared_redis: RedisServer,
    reason: str,
    corrupt: Callable[[bytes, bytes], bytes] | None,
) -> None:
    fmt = kv_format(f"corrupt-{reason}")
    slices = _slices(fmt, SMALL, 3)
    hashes = [s.block_hash for s in slices]
    key = block_key(fmt, hashes[1])
    redis = shared_redis.client()
    async with KVStoreClient(redis_store.address) as kv:
        assert (await kv.put(slices)).num_blocks_stored == 3
        value = redis.get(key)
        assert isinstance(value, bytes)
        if corrupt is None:
            # Well-formed, but of another KV format: written by a buggy or foreign writer.
            bad = encode(kv_format("someone else's"), hashes[1], SMALL, [slices[1].data])
        else:
            other = redis.get(block_key(fmt, hashes[2]))
            assert isinstance(other, bytes)
            bad = corrupt(value, other)
        redis.set(key, bad)
        before = (await kv.stats()).rejected.get(reason, 0)

        got = await kv.get(fmt, hashes)
        assert [b.data for b in got] == [slices[0].data]  # the stream ends before the bad block
        assert redis.exists(key) == 0
        assert (await kv.stats()).rejected.get(reason, 0) == before + 1
        assert await kv.lookup(fmt, hashes) == 1

        # Deleted, so the next writer stores it again.
        again = await kv.put(slices)
        assert (again.num_blocks_stored, again.num_blocks_existing) == (1, 2)
        assert [b.data for b in await kv.get(fmt, hashes)] == [s.data for s in slices]
    redis.close()


def _put_case(chunks: list[kvstore_pb2.PutChunk]) -> Callable[[KVStoreClient], Awaitable[object]]:
    return lambda kv: kv.put_chunks(chunks)


def _header(fmt: str, **fields: object) -> kvstore_pb2.BlockHeader:
    values: dict[str, object] = {
        "kv_format": fmt,
        "block_hash": b"\x07" * 32,
        "shape": shape_to_proto(SMALL),
        "head_start": 0,
        "head_count": 2,
    }
    values.update(fields)
    return kvstore_pb2.BlockHeader(**values)  # type: ignore[arg-type]


def _bad_cases(
    fmt: str, stored: list[Slice]
) -> list[tuple[str, Callable[[KVStoreClient], Awaitable[object]], grpc.StatusCode, str]]:
    hashes = [s.block_hash for s in stored]
    whole = SMALL.payload_bytes
    invalid, out_of_range = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE
    huge = kvstore_pb2.BlockShape(num_kv_heads=64, num_layers=64, block_size=1024, head_dim=128, dtype="float32")
    chunk = kvstore_pb2.PutChunk
    return [
        ("lookup bad format", lambda kv: kv.lookup("meshserve-kv1:XYZ", hashes), invalid, "kv_format"),
        ("lookup short hash", lambda kv: kv.lookup(fmt, [hashes[0], b"x" * 31]), invalid, "block_hashes[1]"),
        ("lookup too many", lambda kv: kv.lookup(fmt, [hashes[0]] * (MAX_BLOCK_HASHES + 1)), out_of_range,
         "block_hashes"),
        ("get bad format", lambda kv: kv.get("meshserve-kv2:" + "0" * 64, hashes), invalid, "kv_format"),
        ("get long hash", lambda kv: kv.get(fmt, [b"x" * 33]), invalid, "block_hashes[0]"),
        ("get too many", lambda kv: kv.get(fmt, [hashes[0]] * (MAX_BLOCK_HASHES + 1)), out_of_range, "block_hashes"),
        ("get head_start", lambda kv: kv.get(fmt, hashes, head_start=2), invalid, "head_start"),
        ("get head_count", lambda kv: kv.get(fmt, hashes, head_start=1, head_count=2), invalid, "head_count"),
        ("data before header", _put_case([chunk(data=b"x")]), invalid, "header"),
        ("chunk too big", _put_case([chunk(header=_header(fmt), data=bytes(MAX_CHUNK_BYTES + 1))]), out_of_range,
         "data"),
        ("header before slice done", _put_case([chunk(header=_header(fmt), data=b"x"), chunk(header=_header(fmt))]),
         invalid, "data"),
        ("stream ends early", _put_case([chunk(header=_header(fmt), data=bytes(whole - 1))]), invalid, "data"),
        ("payload too long", _put_case([chunk(header=_header(fmt), data=bytes(whole + 1))]), invalid, "data"),
        ("heads outside shape", _put_case([chunk(header=_header(fmt, head_start=1))]), invalid, "header.head_start"),
        ("no heads", _put_case([chunk(header=_header(fmt, head_count=0))]), invalid, "header.head_count"),
        ("unknown dtype", _put_case([chunk(header=_header(fmt, shape=kvstore_pb2.BlockShape(
            num_kv_heads=2, num_layers=2, block_size=16, head_dim=64, dtype="int4")))]), invalid, "header.shape.dtype"),
        ("block too big", _put_case([chunk(header=_header(fmt, shape=huge, head_count=1))]), out_of_range,
         "header.shape"),
        ("bad format in header", _put_case([chunk(header=_header("meshserve-kv1:abc"))]), invalid, "header.kv_format"),
        ("bad hash in header", _put_case([chunk(header=_header(fmt, block_hash=b""))]), invalid, "header.block_hash"),
        ("shape conflict", _put_case([chunk(header=_header(fmt, shape=shape_to_proto(BIG)))]), invalid, "header.shape"),
    ]  # fmt: skip


async def test_bad_input_names_the_field_and_harms_no_one_else(memory_store: ServiceProcess) -> None:
    fmt = kv_format("bad input")
    stored = _slices(fmt, SMALL, 4)
    hashes = [s.block_hash for s in stored]
    good = _slices(fmt, SMALL, 8, seed=100)[4:]
    gate = asyncio.Event()

    async with KVStoreClient(memory_store.address) as kv:
        assert (await kv.put(stored)).num_blocks_stored == 4
        # Another caller is mid-Put and mid-Get while the bad calls come and go.
        put_call = asyncio.ensure_future(kv.stub.Put(held_back(good, gate), timeout=60))
        get_call = kv.stub.Get(kvstore_pb2.GetRequest(kv_format=fmt, block_hashes=hashes), timeout=60)
        first = await get_call.read()
        assert isinstance(first, kvstore_pb2.GetChunk) and first.header.index == 0

        for name, call, code, field in _bad_cases(fmt, stored):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(kv)
            assert caught.value.code() == code, name
            assert [f for f, _ in field_violations(caught.value)] == [field], name
            assert (caught.value.details() or "").startswith(f"{field}: "), name

        # Blocks completed before a bad chunk stay stored.
        early = _slices(fmt, SMALL, 10, seed=200)[8:]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await kv.put_chunks([*early[0].chunks(), kvstore_pb2.PutChunk(data=b"stray")])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await kv.lookup(fmt, [early[0].block_hash]) == 1

        gate.set()
        assert (await put_call).num_blocks_stored == len(good)
        rest: list[kvstore_pb2.GetChunk] = [first]
        while (message := await get_call.read()) is not grpc.aio.EOF:
            assert isinstance(message, kvstore_pb2.GetChunk)
            rest.append(message)
        assert b"".join(m.data for m in rest) == b"".join(s.data for s in stored)
        assert [b.data for b in await kv.get(fmt, [*hashes, *(s.block_hash for s in good)])] == [
            s.data for s in [*stored, *good]
        ]
        assert await kv.health_status() == SERVING


async def test_replicas_on_one_redis_share_blocks_and_formats(
    launcher: Launcher, redis_store: ServiceProcess, shared_redis: RedisServer
) -> None:
    replica = launch_kvstore(launcher, "kvstore-replica", shared_redis.url, ["--ttl-seconds", "3600"])
    await launcher.wait_healthy(replica, 30)
    fmt = kv_format("replicas")
    slices = _slices(fmt, BIG, 4)
    hashes = [s.block_hash for s in slices]
    redis = shared_redis.client()
    async with KVStoreClient(redis_store.address) as one, KVStoreClient(replica.address) as two:
        assert (await one.put(slices[:3])).num_blocks_stored == 3
        assert await two.lookup(fmt, hashes) == 3
        assert [b.data for b in await two.get(fmt, hashes, 0, 2)] == [_heads(s.data, BIG, 0, 2) for s in slices[:3]]
        assert (await two.put(slices)).num_blocks_existing == 3
        assert [b.data for b in await one.get(fmt, hashes)] == [s.data for s in slices]
        # Only the replica sets an expiry (--ttl-seconds), and a block is never rewritten to add one.
        assert redis.ttl(block_key(fmt, hashes[0])) == -1
        assert 0 < int(redis.ttl(block_key(fmt, hashes[3]))) <= 3600  # type: ignore[arg-type]
        # The shape registered through one replica binds the other.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await two.put(_slices(fmt, SMALL, 1, seed=9))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(caught.value)] == ["header.shape"]
    redis.close()


async def test_redis_outage_answers_misses_and_recovers_by_itself(log_dir: Path) -> None:
    redis = RedisServer(log_dir)
    redis.start()
    launcher = kvstore_launcher(log_dir / "outage")
    try:
        metrics_port = free_port()
        store = launch_kvstore(launcher, "kvstore-outage", redis.url, ["--metrics-port", str(metrics_port)])
        await launcher.wait_healthy(store, 30)
        fmt = kv_format("outage")
        slices = _slices(fmt, SMALL, 3)
        hashes = [s.block_hash for s in slices]
        async with KVStoreClient(store.address) as kv:
            await kv.wait_health(BACKEND_HEALTH_NAME, SERVING)
            assert (await kv.put(slices)).num_blocks_stored == 3

            # Hung: connections stay open and nothing answers. The socket timeout (--redis-timeout, 1 s)
            # turns the call into a miss well within the caller's deadline.
            redis.pause(True)
            assert await kv.lookup(fmt, hashes, timeout=10) == 0
            await kv.wait_health(BACKEND_HEALTH_NAME, NOT_SERVING)
            redis.pause(False)
            await kv.wait_health(BACKEND_HEALTH_NAME, SERVING)
            assert await kv.lookup(fmt, hashes) == 3

            redis.stop()
            assert await kv.lookup(fmt, hashes) == 0
            assert await kv.get(fmt, hashes) == []
            dropped = await kv.put(_slices(fmt, SMALL, 5)[3:])
            assert (dropped.num_blocks_stored, dropped.num_blocks_dropped) == (0, 2)
            await kv.wait_health(BACKEND_HEALTH_NAME, NOT_SERVING)
            assert await kv.health_status() == SERVING
            assert await kv.health_status(SERVICE_NAME) == SERVING
            assert not (await kv.stats()).backend_serving

            # Back on the same port (empty: it kept nothing): the store notices without being restarted.
            redis.start()
            await kv.wait_health(BACKEND_HEALTH_NAME, SERVING)
            assert (await kv.stats()).backend_serving
            assert (await kv.put(slices)).num_blocks_stored == 3
            assert [b.data for b in await kv.get(fmt, hashes)] == [s.data for s in slices]
            assert await kv.lookup(fmt, hashes) == 3

        metrics = await asyncio.to_thread(scrape_metrics, metrics_port)
        assert 'meshserve:kvstore_dropped_blocks_total{reason="backend_unavailable"} 2.0' in metrics
        assert "meshserve:kvstore_backend_serving 1.0" in metrics
        assert 'meshserve:kvstore_backend_latency_seconds_count{op="put"}' in metrics
        names = {line.split("{")[0].split()[0] for line in metrics.splitlines() if line.startswith("meshserve")}
        assert names and all(n.startswith("meshserve:kvstore_") for n in names)
    finally:
        launcher.stop_all(timeout=10)
        redis.stop()


async def test_sigterm_drains_a_put_in_flight_then_exits_zero(log_dir: Path) -> None:
    launcher = kvstore_launcher(log_dir / "sigterm")
    try:
        store = launch_kvstore(launcher, "kvstore-sigterm")
        await launcher.wait_healthy(store, 30)
        fmt = kv_format("sigterm")
        (block,) = _slices(fmt, BIG, 1)
        chunks = block.chunks()
        gate = asyncio.Event()

        async def half_then_held() -> AsyncIterator[kvstore_pb2.PutChunk]:
            yield chunks[0]
            yield chunks[1]
            await gate.wait()
            for chunk in chunks[2:]:
                yield chunk

        async with KVStoreClient(store.address) as kv:
            call = asyncio.ensure_future(kv.stub.Put(half_then_held(), timeout=60))
            while (await kv.stats()).bytes_in == 0:  # the store holds half a block
                await asyncio.sleep(0.02)
            store.process.send_signal(signal.SIGTERM)
            # Draining: health says NOT_SERVING, or new calls are refused already.
            while True:
                try:
                    if await kv.health_status() == NOT_SERVING:
                        break
                except grpc.aio.AioRpcError:
                    break
                await asyncio.sleep(0.02)
            assert store.process.poll() is None
            gate.set()
            assert (await call).num_blocks_stored == 1
        assert await asyncio.to_thread(store.process.wait, 30) == 0
    finally:
        launcher.stop_all(timeout=10)


def _rss_bytes(service: ServiceProcess) -> int:
    for line in Path(f"/proc/{service.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {service.name}")


async def test_a_memory_store_takes_its_capacity_up_front_unless_told_not_to(launcher: Launcher) -> None:
    capacity = 384 << 20
    reserved = launch_kvstore(launcher, "kvstore-reserved", args=["--capacity", "384MiB"])
    lazy = launch_kvstore(launcher, "kvstore-lazy", args=["--capacity", "384MiB", "--no-reserve-memory"])
    for store in (reserved, lazy):
        await launcher.wait_healthy(store, 60)
    deadline = time.monotonic() + 120
    while _rss_bytes(reserved) < capacity and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert _rss_bytes(reserved) >= capacity, reserved.log_tail()
    # The same store told not to takes memory only as blocks arrive: the interpreter and its libraries.
    assert _rss_bytes(lazy) < capacity // 2
    for store in (reserved, lazy):
        fmt = kv_format(f"reserve-{store.name}")
        slices = _slices(fmt, BIG, 4, seed=7)
        async with KVStoreClient(store.address) as kv:
            assert (await kv.put(slices)).num_blocks_stored == 4
            assert [b.data for b in await kv.get(fmt, [s.block_hash for s in slices])] == [s.data for s in slices]
