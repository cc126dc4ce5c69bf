"""PutChunk.shared against real kvstore processes: blocks handed over in a writer's shared memory.

The writer side is the worker's own outbox (services/worker/kv_outbox.py) in /dev/shm, as a worker on
the store's host uses it; the store reads it, stores the same bytes a data Put would, and refuses what it
cannot or must not read with the status and field the contract gives, while other callers' streams go on.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.client.launcher import Launcher, ServiceProcess
from services.common.errors import error_reason
from services.common.kv_shared_memory import SHM_DIR, new_segment_name
from services.common.kv_store_limits import MAX_CHUNK_BYTES
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import kvstore_pb2
from services.worker.kv_outbox import KVOutbox
from tests.support.kvstore import (
    BIG,
    SMALL,
    KVStoreClient,
    Slice,
    block_hashes,
    held_back,
    kv_format,
    kvstore_launcher,
    launch_kvstore,
    payload,
)
from tests.support.scrape import scrape_metrics

Range = kvstore_pb2.SharedMemoryRange


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    launcher = kvstore_launcher(tmp_path_factory.mktemp("kvstore-shm"))
    yield launcher
    launcher.stop_all(timeout=10)


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def store(launcher: Launcher, metrics_port: int) -> ServiceProcess:
    service = launch_kvstore(launcher, "kvstore-shm", args=["--metrics-port", str(metrics_port)])
    asyncio.run(launcher.wait_healthy(service, 60))
    return service


@pytest.fixture(scope="module")
def store_without_shm(launcher: Launcher) -> ServiceProcess:
    service = launch_kvstore(launcher, "kvstore-no-shm", args=["--no-shared-memory"])
    asyncio.run(launcher.wait_healthy(service, 60))
    return service


@pytest.fixture
def outbox() -> Iterator[KVOutbox]:
    box = KVOutbox(BIG.payload_bytes, 4)
    yield box
    box.close()


def _shared_chunks(outbox: KVOutbox, slices: list[Slice]) -> list[kvstore_pb2.PutChunk]:
    """Each slice written to its own slot and named by range, as the worker's save thread does."""
    chunks = []
    for slot, piece in enumerate(slices):
        header = piece.chunks()[0].header
        for n, shared in enumerate(outbox.write(slot, memoryview(piece.data))):
            chunks.append(
                kvstore_pb2.PutChunk(header=header, shared=shared) if n == 0 else kvstore_pb2.PutChunk(shared=shared)
            )
    return chunks


def _shared_bytes_metric(port: int) -> float:
    for line in scrape_metrics(port).splitlines():
        if line.startswith("meshserve:kvstore_shared_memory_bytes_in_total "):
            return float(line.split()[1])
    raise AssertionError("no shared-memory bytes counter in the store's metrics")


async def test_a_put_by_shared_memory_stores_the_same_bytes_as_one_by_data(
    store: ServiceProcess, outbox: KVOutbox, metrics_port: int
) -> None:
    fmt = kv_format("shm round trip")
    by_memory = [Slice(fmt, h, BIG, payload(BIG, i)) for i, h in enumerate(block_hashes(fmt, 3))]
    by_data = [Slice(fmt, h, BIG, payload(BIG, 10 + i)) for i, h in enumerate(block_hashes(fmt + "x", 2))]
    before = _shared_bytes_metric(metrics_port)
    async with KVStoreClient(store.address) as kv:
        chunks = _shared_chunks(outbox, by_memory)
        # Two ranges a block: 1.25 MiB is more than one chunk's 1 MiB.
        assert len(chunks) == 6 and all(c.shared.length <= MAX_CHUNK_BYTES for c in chunks)
        assert (await kv.put_chunks(chunks)).num_blocks_stored == 3
        assert (await kv.put(by_data)).num_blocks_stored == 2
        # The store copied them out: the writer may overwrite its slots once the Put has answered.
        outbox.write(0, memoryview(bytes(BIG.payload_bytes)))
        got = await kv.get(fmt, [s.block_hash for s in by_memory])
        assert [b.data for b in got] == [s.data for s in by_memory]
        assert [b.data for b in await kv.get(fmt, [s.block_hash for s in by_data])] == [s.data for s in by_data]
        # A head slice by shared memory is held in staging until the other heads come by data.
        fmt2 = kv_format("shm staged")
        [block_hash] = block_hashes(fmt2, 1)
        data = payload(SMALL, 7)
        first = Slice(fmt2, block_hash, SMALL, data, head_start=0, head_count=1)
        second = Slice(fmt2, block_hash, SMALL, data, head_start=1, head_count=1)
        half = len(data) // 2
        ranges = outbox.write(1, memoryview(data[:half]))
        held = await kv.put_chunks([kvstore_pb2.PutChunk(header=first.chunks()[0].header, shared=ranges[0])])
        assert held.num_slices_pending == 1
        outbox.write(1, memoryview(bytes(half)))  # the slot reused before the rest arrives
        assert (await kv.put([second])).num_blocks_stored == 1
        assert [b.data for b in await kv.get(fmt2, [block_hash])] == [data]
    assert _shared_bytes_metric(metrics_port) - before == 3 * BIG.payload_bytes + half


def _case(
    name: str, chunk: kvstore_pb2.PutChunk, code: grpc.StatusCode, field: str
) -> tuple[str, kvstore_pb2.PutChunk, grpc.StatusCode, str]:
    return name, chunk, code, field


async def test_ranges_it_cannot_or_must_not_read_are_refused_and_harm_no_one_else(
    store: ServiceProcess, store_without_shm: ServiceProcess, outbox: KVOutbox, tmp_path: Path
) -> None:
    fmt = kv_format("shm refused")
    header = Slice(fmt, block_hashes(fmt, 1)[0], SMALL, payload(SMALL, 0)).chunks()[0].header
    [good_range] = outbox.write(0, memoryview(payload(SMALL, 0)))
    segment = outbox.name
    size = outbox.num_slots * outbox.slot_nbytes
    # A name of the right form whose file is a symlink to one of ours: never followed.
    linked = new_segment_name()
    os.symlink(SHM_DIR / segment, SHM_DIR / linked)
    invalid, out_of_range = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    chunk = kvstore_pb2.PutChunk
    cases = [
        _case("a path", chunk(header=header, shared=Range(segment="../etc/passwd", length=1)), invalid,
              "shared.segment"),
        _case("another file", chunk(header=header, shared=Range(segment="PostgreSQL.1", length=1)), invalid,
              "shared.segment"),
        _case("data too", chunk(header=header, data=b"x", shared=good_range), invalid, "shared"),
        _case("empty range", chunk(header=header, shared=Range(segment=segment, length=0)), out_of_range,
              "shared.length"),
        _case("range over a chunk", chunk(header=header, shared=Range(segment=segment, length=MAX_CHUNK_BYTES + 1)),
              out_of_range, "shared.length"),
        _case("past the end", chunk(header=header, shared=Range(segment=segment, offset=size - 10, length=20)),
              out_of_range, "shared.offset"),
        _case("huge offset", chunk(header=header, shared=Range(segment=segment, offset=2**63, length=1)),
              out_of_range, "shared.offset"),
        _case("no such segment", chunk(header=header, shared=Range(segment=new_segment_name(), length=1)),
              precondition, "shared.segment"),
        _case("a symlink", chunk(header=header, shared=Range(segment=linked, length=1)), precondition,
              "shared.segment"),
    ]  # fmt: skip
    good_fmt = kv_format("shm refused, beside")
    good = [Slice(good_fmt, h, BIG, payload(BIG, 50 + i)) for i, h in enumerate(block_hashes(good_fmt, 3))]
    gate = asyncio.Event()

    try:
        async with KVStoreClient(store.address) as kv, KVStoreClient(store_without_shm.address) as off:
            # Another caller is mid-Put while the refused calls come and go.
            put_call = asyncio.ensure_future(kv.stub.Put(held_back(good, gate), timeout=60))
            for name, bad, code, field in cases:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await kv.put_chunks([bad])
                assert caught.value.code() == code, name
                assert (caught.value.details() or "").startswith(f"{field}: "), name
                if code == precondition:
                    assert error_reason(caught.value) == "SHARED_MEMORY_UNREADABLE", name
            # A store with shared memory off refuses even a good range, and says how to do without.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await off.put_chunks([chunk(header=header, shared=good_range)])
            assert caught.value.code() == precondition
            assert "--no-shared-memory" in (caught.value.details() or "")
            assert "send the payload in data" in (caught.value.details() or "")
            gate.set()
            assert (await put_call).num_blocks_stored == len(good)
            assert [b.data for b in await kv.get(good_fmt, [s.block_hash for s in good])] == [s.data for s in good]
            # The good range itself is read fine.
            assert (await kv.put_chunks([chunk(header=header, shared=good_range)])).num_blocks_stored == 1
    finally:
        (SHM_DIR / linked).unlink(missing_ok=True)
