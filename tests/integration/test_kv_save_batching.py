"""The worker's save thread gathers saves from several steps into one Put (SAVE_LINGER_S), over real gRPC.

A store in this process records how many blocks each Put stream carried; the KVTransfer under test is the
worker's own, over a real CPU cache.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
import torch

from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2
from services.worker.kv_blocks import SliceGeometry
from services.worker.kv_cache import KVCache
from services.worker.kv_transfer import PUT_BATCH_BLOCKS, KVTransfer
from services.worker.layers.attention import HND
from services.worker.platforms.cpu import CpuPlatform

FORMAT = "meshserve-kv1:" + "cd" * 32
GEOMETRY = SliceGeometry(
    num_kv_heads=2, num_layers=2, block_size=4, head_dim=8, dtype=torch.float32, head_start=0, head_count=2
)
NUM_BLOCKS = PUT_BATCH_BLOCKS + 8
# Generous: the save thread runs beside whatever else a loaded CI machine runs.
WAIT_S = 60.0


class CountingStore(kvstore_pb2_grpc.KVBlockStoreServicer):
    """Takes every Put and records how many blocks each stream carried."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.puts: list[int] = []

    def Put(
        self, request_iterator: Iterator[kvstore_pb2.PutChunk], context: grpc.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        blocks = sum(1 for chunk in request_iterator if chunk.HasField("header"))
        with self.lock:
            self.puts.append(blocks)
        return kvstore_pb2.PutResponse(num_blocks_stored=blocks)

    def Lookup(self, request: kvstore_pb2.LookupRequest, context: grpc.ServicerContext) -> kvstore_pb2.LookupResponse:
        raise NotImplementedError

    def Get(self, request: kvstore_pb2.GetRequest, context: grpc.ServicerContext) -> Iterator[kvstore_pb2.GetChunk]:
        raise NotImplementedError

    def Stats(self, request: kvstore_pb2.StatsRequest, context: grpc.ServicerContext) -> kvstore_pb2.StoreStats:
        raise NotImplementedError


@pytest.fixture
def store() -> Iterator[tuple[CountingStore, str]]:
    servicer = CountingStore()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    kvstore_pb2_grpc.add_KVBlockStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


@contextmanager
def _transfer(address: str, linger_s: float) -> Iterator[KVTransfer]:
    """The worker's KVTransfer over a fresh CPU cache, closed on leaving."""
    cache = KVCache.allocate(
        num_blocks=NUM_BLOCKS,
        num_layers=GEOMETRY.num_layers,
        block_size=GEOMETRY.block_size,
        num_kv_heads=GEOMETRY.num_kv_heads,
        head_dim=GEOMETRY.head_dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layout=HND,
    )
    transfer = KVTransfer(
        address, FORMAT, GEOMETRY, cache.layers, HND, CpuPlatform(), save_queue_blocks=4 * NUM_BLOCKS,
        save_linger_s=linger_s,
    )  # fmt: skip
    try:
        yield transfer
    finally:
        transfer.close()


def _refs(block_ids: range, salt: str) -> list[worker_pb2.KVBlockRef]:
    return [
        worker_pb2.KVBlockRef(block_id=b, block_hash=hashlib.sha256(f"{salt}-{b}".encode()).digest()) for b in block_ids
    ]


def _wait_saved(transfer: KVTransfer, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while transfer.stats.blocks_saved < count:
        assert time.monotonic() < deadline, f"{transfer.stats.blocks_saved} of {count} blocks saved"
        time.sleep(0.01)


def test_saves_of_several_steps_go_in_one_put(store: tuple[CountingStore, str]) -> None:
    servicer, address = store
    # A linger no test outlives: the saves can only go together, because a whole Put's worth is queued.
    with _transfer(address, linger_s=3600.0) as transfer:
        transfer.save(_refs(range(0, 2), "steps"))
        transfer.save(_refs(range(2, 3), "steps"))
        transfer.save(_refs(range(3, 5), "steps"))
        # The fourth step's saves make a whole Put's worth: the four steps go together, at once.
        transfer.save(_refs(range(5, PUT_BATCH_BLOCKS), "steps"))
        _wait_saved(transfer, PUT_BATCH_BLOCKS)
        assert servicer.puts == [PUT_BATCH_BLOCKS]


def test_a_lone_save_goes_once_the_linger_ends(store: tuple[CountingStore, str]) -> None:
    servicer, address = store
    with _transfer(address, linger_s=0.2) as transfer:
        transfer.save(_refs(range(0, 1), "lone"))
        _wait_saved(transfer, 1)
        transfer.save(_refs(range(1, 3), "lone"))
        _wait_saved(transfer, 3)
        assert servicer.puts == [1, 2]


def test_a_flush_sends_the_queued_saves_without_waiting_out_the_linger(store: tuple[CountingStore, str]) -> None:
    servicer, address = store
    with _transfer(address, linger_s=3600.0) as transfer:
        transfer.save(_refs(range(0, 2), "flush"))
        transfer.save(_refs(range(2, 3), "flush"))
        transfer.flush_saves()
        _wait_saved(transfer, 3)
        # Saves after the flush linger again: they wait for more (or for the next flush).
        transfer.save(_refs(range(3, 5), "flush"))
        time.sleep(0.3)
        assert transfer.stats.blocks_saved == 3
        transfer.flush_saves()
        _wait_saved(transfer, 5)
        assert servicer.puts == [3, 2]


@pytest.mark.parametrize("queued", [3, 0])
def test_close_ends_the_linger(store: tuple[CountingStore, str], queued: int, monkeypatch: pytest.MonkeyPatch) -> None:
    servicer, address = store
    failures: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    with _transfer(address, linger_s=3600.0) as transfer:
        if queued:
            transfer.save(_refs(range(0, queued), "close"))
        transfer.close()
    # close() joins the save thread (with a timeout): it must have ended, not be waiting out the linger,
    # and ended by returning, not by an exception.
    assert not transfer._save_thread.is_alive()
    assert failures == []
    assert servicer.puts == []
