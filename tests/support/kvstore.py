"""Run a kvstore process and a private redis-server on free ports, and talk to the store."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.launcher import Launcher, ServiceProcess
from services.common.channels import insecure_channel
from services.common.kv_store_limits import MAX_CHUNK_BYTES
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.block_format import BlockShape
from services.kvstore.validation import shape_to_proto

REDIS_SERVER = "/usr/bin/redis-server"
STARTUP_TIMEOUT_S = 30.0
# Block shapes of the store's tests. BIG: 1.25 MiB blocks, two data chunks (or shared ranges) each; a
# two-head slice (640 KiB) is one. SMALL: 8 KiB blocks.
BIG = BlockShape(num_kv_heads=4, num_layers=20, block_size=16, head_dim=128, dtype="float32")
SMALL = BlockShape(num_kv_heads=2, num_layers=2, block_size=16, head_dim=64, dtype="bfloat16")

# Runs redis-server as a child that gets SIGKILL when the test process dies by any means, as the
# launcher does for services (PR_SET_PDEATHSIG survives execve).
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("the test process exited before redis-server started")
os.execv(sys.argv[2], sys.argv[2:])
"""


def kv_format(seed: str) -> str:
    """A valid KV format key, distinct per seed."""
    return "meshserve-kv1:" + hashlib.sha256(seed.encode()).hexdigest()


def block_hashes(seed: str, n: int) -> list[bytes]:
    """n distinct 32-byte block hashes."""
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def payload(shape: BlockShape, seed: int) -> bytes:
    """A block's worth of reproducible random bytes."""
    return random.Random(seed).randbytes(shape.payload_bytes)


@dataclass(frozen=True)
class Slice:
    """Heads [head_start, head_start + head_count) of one block, to put."""

    kv_format: str
    block_hash: bytes
    shape: BlockShape
    data: bytes  # the whole block's payload; the slice takes its heads' byte range
    head_start: int = 0
    head_count: int = 0  # 0: all heads

    def chunks(self, chunk_bytes: int = MAX_CHUNK_BYTES) -> list[kvstore_pb2.PutChunk]:
        """The PutChunks of this slice: a header, then data chunks of at most chunk_bytes."""
        count = self.head_count or self.shape.num_kv_heads - self.head_start
        per_head = self.shape.bytes_per_head
        body = self.data[self.head_start * per_head : (self.head_start + count) * per_head]
        header = kvstore_pb2.BlockHeader(
            kv_format=self.kv_format,
            block_hash=self.block_hash,
            shape=shape_to_proto(self.shape),
            head_start=self.head_start,
            head_count=count,
        )
        return [
            kvstore_pb2.PutChunk(header=header),
            *(kvstore_pb2.PutChunk(data=body[i : i + chunk_bytes]) for i in range(0, len(body), chunk_bytes)),
        ]


@dataclass
class GotBlock:
    """One block read by Get, its checksum verified by the reader."""

    header: kvstore_pb2.GetBlockHeader
    data: bytes


async def held_back(slices: Sequence[Slice], gate: asyncio.Event) -> AsyncIterator[kvstore_pb2.PutChunk]:
    """A well-behaved Put's chunks: the first slice, then (once gate is set) the rest: a stream left open
    while other callers misbehave beside it."""
    for chunk in slices[0].chunks():
        yield chunk
    await gate.wait()
    for piece in slices[1:]:
        for chunk in piece.chunks():
            yield chunk


async def _iterate(chunks: Sequence[kvstore_pb2.PutChunk]) -> AsyncIterator[kvstore_pb2.PutChunk]:
    for chunk in chunks:
        yield chunk


class KVStoreClient:
    """A channel to one kvstore, with whole-block helpers."""

    def __init__(self, address: str) -> None:
        self.channel = insecure_channel(address)
        self.stub = kvstore_pb2_grpc.KVBlockStoreStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.channel.close()

    async def put(self, slices: Sequence[Slice], chunk_bytes: int = MAX_CHUNK_BYTES) -> kvstore_pb2.PutResponse:
        """Put the slices on one stream."""
        return await self.put_chunks([c for s in slices for c in s.chunks(chunk_bytes)])

    async def put_chunks(self, chunks: Sequence[kvstore_pb2.PutChunk]) -> kvstore_pb2.PutResponse:
        """Put raw chunks on one stream."""
        response: kvstore_pb2.PutResponse = await self.stub.Put(_iterate(chunks), timeout=60)
        return response

    async def get(
        self, kv_format: str, hashes: Sequence[bytes], head_start: int = 0, head_count: int = 0
    ) -> list[GotBlock]:
        """Read a chain; checks the framing, indices and each slice's checksum."""
        blocks: list[GotBlock] = []
        request = kvstore_pb2.GetRequest(
            kv_format=kv_format, block_hashes=hashes, head_start=head_start, head_count=head_count
        )
        parts: list[bytes] = []
        async for chunk in self.stub.Get(request, timeout=60):
            assert len(chunk.data) <= MAX_CHUNK_BYTES
            if chunk.HasField("header"):
                if blocks:
                    blocks[-1].data = b"".join(parts)
                parts = []
                assert chunk.header.index == len(blocks)
                blocks.append(GotBlock(chunk.header, b""))
            else:
                assert blocks, "data before the first header"
            parts.append(chunk.data)
        if blocks:
            blocks[-1].data = b"".join(parts)
        for block in blocks:
            assert len(block.data) == block.header.payload_length
            assert xxhash.xxh3_64_intdigest(block.data) == block.header.checksum
        return blocks

    async def lookup(self, kv_format: str, hashes: Sequence[bytes], timeout: float = 60) -> int:
        """Leading hashes stored."""
        request = kvstore_pb2.LookupRequest(kv_format=kv_format, block_hashes=hashes)
        response = await self.stub.Lookup(request, timeout=timeout)
        return int(response.num_present)

    async def stats(self) -> kvstore_pb2.StoreStats:
        """The store's counters."""
        stats: kvstore_pb2.StoreStats = await self.stub.Stats(kvstore_pb2.StatsRequest(), timeout=10)
        return stats

    async def health_status(self, service: str = "") -> int:
        """grpc.health.v1 status of one service name."""
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)

    async def wait_health(self, service: str, status: int, timeout: float = 20.0) -> None:
        """Poll until the service reports status."""
        deadline = time.monotonic() + timeout
        while (current := await self.health_status(service)) != status:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service or 'server'} health is {current}, not {status}, after {timeout:.0f}s")
            await asyncio.sleep(0.05)


class RedisServer:
    """A private redis-server on a free loopback port, without persistence; stop() and start() keep the port."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_dir / f"redis-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT/0."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A synchronous redis-py client, to look at or tamper with stored values."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        """Start (again, on the same port) and wait until it answers PING."""
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        client = self.client()
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self.log_path.read_text(errors='replace')[-2000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} does not answer")
                time.sleep(0.05)
        finally:
            client.close()

    def pause(self, paused: bool) -> None:
        """SIGSTOP (a hung Redis: connections open, nothing answers) or SIGCONT."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        """SIGKILL (an outage, not a shutdown) and wait for it to be gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None


# A memory store takes its whole --capacity up front (--reserve-memory); a test's blocks fit in far less than
# the 4 GiB default, and a later --capacity in a test's own args wins.
TEST_STORE_CAPACITY = ("--capacity", "512MiB")


def launch_kvstore(launcher: Launcher, name: str, backend: str = "memory", args: Sequence[str] = ()) -> ServiceProcess:
    """Start `meshserve kvstore` on a free port (not waited for: see Launcher.wait_healthy)."""
    port = free_port()
    return launcher.start(
        name,
        ["kvstore", "--host", "127.0.0.1", "--port", str(port), "--backend", backend, *TEST_STORE_CAPACITY, *args],
        f"127.0.0.1:{port}",
    )


def start_kvstore(launcher: Launcher, name: str, backend: str = "memory", args: Sequence[str] = ()) -> ServiceProcess:
    """Start `meshserve kvstore` on a free port and wait until it is SERVING (from synchronous code)."""
    service = launch_kvstore(launcher, name, backend, args)
    try:
        asyncio.run(launcher.wait_healthy(service, STARTUP_TIMEOUT_S))
    except BaseException:
        launcher.stop(service, timeout=5)
        raise
    return service


def kvstore_launcher(log_dir: Path) -> Launcher:
    """A launcher whose services log JSON at debug level into log_dir."""
    return Launcher(log_dir, env={"MESHSERVE_LOG_FORMAT": "json", "MESHSERVE_LOG_LEVEL": "debug"})
