"""Measure the kvstore's Put and Get throughput through gRPC, against this machine's memory-copy bandwidth.

A real `meshserve kvstore` process on loopback, once with the memory backend and once on a private
redis-server; SmolLM2-135M-sized blocks (fp32, 16 tokens: 737,280 bytes); several concurrent streams,
each on its own connection as separate workers would be. Put writes fresh blocks each round; Get reads
them back whole and checks every block's checksum. The ceiling is one large in-process buffer copy
(numpy), the least any byte that crosses gRPC costs. Between the two sits a "null store": a process
with the same server options that discards every Put and answers every Get with one fixed block, which
is what gRPC in Python costs without any store behind it.

Other processes' CPU use during each measurement is reported: on a shared machine it lowers every figure.

Prints a table and writes docs/benchmarks/kvstore-throughput.json.

    python scripts/bench_kvstore.py              # about a minute on 2 cores
    python scripts/bench_kvstore.py --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.client.bench.cpu_ticks import machine_ticks, process_ticks, ticks_per_second  # noqa: E402
from services.client.bench.provenance import git_commit  # noqa: E402
from services.client.launcher import Launcher, ServiceProcess  # noqa: E402
from services.common.grpc_server import CHANNEL_OPTIONS, server_options  # noqa: E402
from services.common.kv_store_limits import MAX_CHUNK_BYTES  # noqa: E402
from services.common.ports import free_port  # noqa: E402
from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc  # noqa: E402
from services.kvstore.block_format import BlockShape  # noqa: E402
from services.kvstore.settings import MAX_RECEIVE_MESSAGE_BYTES  # noqa: E402
from services.kvstore.validation import shape_to_proto  # noqa: E402
from tests.support.kvstore import RedisServer, launch_kvstore  # noqa: E402

# SmolLM2-135M: 3 KV heads, 30 layers, head_dim 64; fp32, 16-token blocks.
SHAPE = BlockShape(num_kv_heads=3, num_layers=30, block_size=16, head_dim=64, dtype="float32")
OUT = ROOT / "docs" / "benchmarks" / "kvstore-throughput.json"
# Every stream its own TCP connection, as separate worker processes would have.
STREAM_CHANNEL_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))


@dataclass
class Plan:
    """How much to move."""

    streams: int
    blocks_per_stream: int
    rounds: int

    @property
    def bytes_per_round(self) -> int:
        return self.streams * self.blocks_per_stream * SHAPE.payload_bytes


@dataclass
class Result:
    """One backend's measurements: GB/s (1e9 bytes) of payload per round."""

    backend: str
    put_gbps: list[float]
    get_gbps: list[float]
    # Share of the machine's CPU that other processes used during the measurement.
    other_cpu_share: float = 0.0

    def row(self, ceiling: float) -> str:
        put, get = max(self.put_gbps), max(self.get_gbps)
        return (
            f"| {self.backend} | {put:.2f} | {statistics.median(self.put_gbps):.2f} | {put / ceiling:.1%} "
            f"| {get:.2f} | {statistics.median(self.get_gbps):.2f} | {get / ceiling:.1%} | {self.other_cpu_share:.0%} |"
        )


class NullStore(kvstore_pb2_grpc.KVBlockStoreServicer):
    """Takes Puts and serves Gets with no store behind them: the gRPC transport's own ceiling."""

    def __init__(self) -> None:
        self.block = os.urandom(SHAPE.payload_bytes)
        self.checksum = xxhash.xxh3_64_intdigest(self.block)

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        return kvstore_pb2.LookupResponse(num_present=len(request.block_hashes))

    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StoreStats:
        return kvstore_pb2.StoreStats(backend="null")

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.PutChunk], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        blocks = 0
        async for chunk in request_iterator:
            blocks += chunk.HasField("header")
        return kvstore_pb2.PutResponse(num_blocks_stored=blocks)

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.GetChunk]:
        for index, block_hash in enumerate(request.block_hashes):
            header = kvstore_pb2.GetBlockHeader(
                index=index,
                block_hash=block_hash,
                shape=shape_to_proto(SHAPE),
                head_count=SHAPE.num_kv_heads,
                payload_length=len(self.block),
                checksum=self.checksum,
            )
            yield kvstore_pb2.GetChunk(header=header)
            for offset in range(0, len(self.block), MAX_CHUNK_BYTES):
                yield kvstore_pb2.GetChunk(data=self.block[offset : offset + MAX_CHUNK_BYTES])


async def serve_null(port: int) -> None:
    """Run the null store until SIGTERM (the same server options as every meshserve service)."""
    server = grpc.aio.server(options=server_options(MAX_RECEIVE_MESSAGE_BYTES))
    kvstore_pb2_grpc.add_KVBlockStoreServicer_to_server(NullStore(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1)


@dataclass
class CpuWatch:
    """How much of the machine other processes used while something ran."""

    pids: Sequence[int]
    other_share: float = 0.0
    _busy: int = 0
    _ours: int = 0
    _start: float = 0.0

    def __enter__(self) -> CpuWatch:
        self._busy, self._ours, self._start = machine_ticks()[0], sum(map(process_ticks, self.pids)), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        ticks_per_s = ticks_per_second()
        capacity = (time.monotonic() - self._start) * ticks_per_s * (os.cpu_count() or 1)
        others = (machine_ticks()[0] - self._busy) - (sum(map(process_ticks, self.pids)) - self._ours)
        self.other_share = max(0.0, others / capacity) if capacity else 0.0


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """GB/s of one large buffer copy (best of repeats): read nbytes, write nbytes, counted once."""
    try:
        import numpy as np

        src = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
        dst = np.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - start)
    except ImportError:  # no numpy: a bytes copy is the same memcpy
        data = bytearray(os.urandom(nbytes))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            bytes(data)
            best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _fmt(seed: str) -> str:
    return "meshserve-kv1:" + hashlib.sha256(seed.encode()).hexdigest()


def _hashes(seed: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


async def _put_stream(
    address: str, fmt: str, hashes: Sequence[bytes], payloads: Sequence[bytes]
) -> kvstore_pb2.PutResponse:
    async def chunks() -> AsyncIterator[kvstore_pb2.PutChunk]:
        shape = shape_to_proto(SHAPE)
        for block_hash, data in zip(hashes, payloads, strict=True):
            header = kvstore_pb2.BlockHeader(
                kv_format=fmt, block_hash=block_hash, shape=shape, head_start=0, head_count=SHAPE.num_kv_heads
            )
            yield kvstore_pb2.PutChunk(header=header, data=data[:MAX_CHUNK_BYTES])
            for offset in range(MAX_CHUNK_BYTES, len(data), MAX_CHUNK_BYTES):
                yield kvstore_pb2.PutChunk(data=data[offset : offset + MAX_CHUNK_BYTES])

    async with grpc.aio.insecure_channel(address, options=STREAM_CHANNEL_OPTIONS) as channel:
        await channel.channel_ready()
        response: kvstore_pb2.PutResponse = await kvstore_pb2_grpc.KVBlockStoreStub(channel).Put(chunks(), timeout=300)
        return response


async def _get_stream(address: str, fmt: str, hashes: Sequence[bytes]) -> int:
    """Bytes read; every block's checksum is checked."""
    total = 0
    async with grpc.aio.insecure_channel(address, options=STREAM_CHANNEL_OPTIONS) as channel:
        await channel.channel_ready()
        request = kvstore_pb2.GetRequest(kv_format=fmt, block_hashes=hashes)
        header: kvstore_pb2.GetBlockHeader | None = None
        hasher = xxhash.xxh3_64()
        async for chunk in kvstore_pb2_grpc.KVBlockStoreStub(channel).Get(request, timeout=300):
            if chunk.HasField("header"):
                if header is not None and hasher.intdigest() != header.checksum:
                    raise RuntimeError(f"block {header.index}: checksum mismatch")
                header, hasher = chunk.header, xxhash.xxh3_64()
            hasher.update(chunk.data)
            total += len(chunk.data)
        if header is not None and hasher.intdigest() != header.checksum:
            raise RuntimeError(f"block {header.index}: checksum mismatch")
    return total


async def measure(address: str, backend: str, plan: Plan, pids: Sequence[int]) -> Result:
    """Rounds of concurrent Puts of fresh blocks, each followed by concurrent Gets of them."""
    payloads = [os.urandom(SHAPE.payload_bytes) for _ in range(plan.blocks_per_stream)]
    result = Result(backend, [], [])
    watch = CpuWatch([os.getpid(), *pids])
    with watch:
        await _rounds(address, backend, plan, payloads, result)
    result.other_cpu_share = watch.other_share
    return result


async def _rounds(address: str, backend: str, plan: Plan, payloads: Sequence[bytes], result: Result) -> None:
    for round_ in range(plan.rounds):
        fmt = _fmt(f"bench-{backend}-{round_}-{time.time_ns()}")
        chains = [_hashes(f"{fmt}/{s}", plan.blocks_per_stream) for s in range(plan.streams)]
        start = time.perf_counter()
        puts = await asyncio.gather(*(_put_stream(address, fmt, chain, payloads) for chain in chains))
        put_s = time.perf_counter() - start
        stored = sum(p.num_blocks_stored for p in puts)
        if stored != plan.streams * plan.blocks_per_stream:
            raise RuntimeError(f"{backend}: stored {stored} blocks of {plan.streams * plan.blocks_per_stream}: {puts}")
        start = time.perf_counter()
        got = await asyncio.gather(*(_get_stream(address, fmt, chain) for chain in chains))
        get_s = time.perf_counter() - start
        if sum(got) != plan.bytes_per_round:
            raise RuntimeError(f"{backend}: read {sum(got)} bytes of {plan.bytes_per_round}")
        result.put_gbps.append(plan.bytes_per_round / put_s / 1e9)
        result.get_gbps.append(plan.bytes_per_round / get_s / 1e9)
        print(
            f"  {backend} round {round_ + 1}: put {result.put_gbps[-1]:.2f} GB/s, get {result.get_gbps[-1]:.2f} GB/s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4, help="concurrent Put (then Get) streams")
    parser.add_argument("--blocks-per-stream", type=int, default=96, help="blocks each stream moves per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per backend (the best and median are shown)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 streams x 16 blocks, 1 round")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the JSON")
    parser.add_argument("--serve-null", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the null store's process
    args = parser.parse_args()
    if args.serve_null:
        asyncio.run(serve_null(args.serve_null))
        return
    plan = Plan(2, 16, 1) if args.quick else Plan(args.streams, args.blocks_per_stream, args.rounds)

    ceiling = copy_bandwidth()
    print(
        f"block {SHAPE.payload_bytes:,} bytes; {plan.streams} streams x {plan.blocks_per_stream} blocks "
        f"= {plan.bytes_per_round / 1e6:.0f} MB per round; memory copy {ceiling:.2f} GB/s",
        flush=True,
    )
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-kvstore-") as tmp:
        log_dir = Path(tmp)
        launcher = Launcher(log_dir, env={"MESHSERVE_LOG_FORMAT": "json", "MESHSERVE_LOG_LEVEL": "warning"})
        redis = RedisServer(log_dir)
        null_port = free_port()
        null = subprocess.Popen([sys.executable, __file__, "--serve-null", str(null_port)])
        try:
            redis.start()
            assert redis.process is not None
            # Room for every round's blocks: nothing is evicted while measuring.
            capacity = str(plan.bytes_per_round * plan.rounds * 2)
            runs: list[tuple[str, str, list[int], ServiceProcess | None]] = [
                ("null store (gRPC only)", f"127.0.0.1:{null_port}", [null.pid], None)
            ]
            for backend, url, extra in (("memory", "memory", ["--capacity", capacity]), ("redis", redis.url, [])):
                store = launch_kvstore(launcher, f"kvstore-{backend}", url, extra)
                asyncio.run(launcher.wait_healthy(store, 30))
                pids = [store.process.pid] + ([redis.process.pid] if backend == "redis" else [])
                runs.append((backend, store.address, pids, store))
            for backend, address, pids, service in runs:
                results.append(asyncio.run(measure(address, backend, plan, pids)))
                if service is not None:
                    launcher.stop(service, timeout=10)
        finally:
            null.terminate()
            null.wait(10)
            launcher.stop_all(timeout=10)
            redis.stop()

    print()
    print(
        "| backend | put GB/s (best) | put GB/s (median) | put / copy | get GB/s (best) | get GB/s (median) "
        "| get / copy | other CPU |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for result in results:
        print(result.row(ceiling))
    print(f"| memory copy (ceiling) | {ceiling:.2f} | | 100% | {ceiling:.2f} | | 100% | |")

    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(ROOT),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "block_bytes": SHAPE.payload_bytes,
        "shape": asdict(SHAPE),
        "plan": asdict(plan) | {"bytes_per_round": plan.bytes_per_round},
        "copy_gbps": ceiling,
        "results": [asdict(r) | {"put_best_gbps": max(r.put_gbps), "get_best_gbps": max(r.get_gbps)} for r in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
