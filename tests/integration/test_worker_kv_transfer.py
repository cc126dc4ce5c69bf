"""The worker's kvstore loads and saves: ModelRunners driven by hand-built Steps against a real kvstore process.

A prefill's blocks saved by one runner load into another runner's fresh cache (other cache layout, other
block ids, also a TP=2 group) and its greedy continuation equals recomputing the prefix; a store that is
down or lacks a block ends a load early without failing a step. What a real store never sends (a bad
checksum, a wrong shape, a truncated slice) is served by a small in-process stand-in.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
import xxhash

from services.client.launcher import Launcher, ServiceProcess
from services.common.kv_shared_memory import SEGMENT_PREFIX, SHM_DIR
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc, sampling_pb2, worker_pb2
from services.worker.distributed import DistInit
from services.worker.engine_config import EngineConfig, KVStoreConnection
from services.worker.kv_blocks import SliceGeometry, gather_blocks
from services.worker.kv_cache import KVCache
from services.worker.kv_transfer import KVTransfer
from services.worker.layers.attention import HND, NHD
from services.worker.model_runner import ModelRunner
from services.worker.platforms.base import Ops
from services.worker.platforms.cpu import CpuPlatform
from services.worker.platforms.reference_ops import ReferenceOps
from services.worker.ranks import RankDriver, RankSpec, spawn_local_ranks
from tests.support.kvstore import kvstore_launcher, start_kvstore
from tests.support.tiny_model import make_tiny_model, transformers_greedy

GREEDY = sampling_pb2.SamplingParams(temperature=0)
BLOCK = 4
# 3 full blocks of prefix and 2 more tokens: the continuation reads the loaded blocks.
PROMPT = [5, 9, 100, 200, 7, 8, 1, 2, 3, 4, 250, 251, 252, 253]
FULL_BLOCKS = len(PROMPT) // BLOCK
MAX_NEW = 6
# Generous: loads and saves run on background threads of a loaded CI machine.
WAIT_S = 60.0


class NhdCpuPlatform(CpuPlatform):
    """The CPU with the reference ops over an NHD cache (the CPU's own is HND): Ascend's layout, here."""

    def __init__(self) -> None:
        super().__init__(kernels="reference")
        self._nhd = ReferenceOps(NHD)

    @property
    def ops(self) -> Ops:
        return self._nhd


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two KV heads: a TP=2 group really splits them, one per rank.
    return make_tiny_model(tmp_path_factory.mktemp("kv-llama"), num_heads=4, num_kv_heads=2, num_layers=2)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    launcher = kvstore_launcher(tmp_path_factory.mktemp("kvstore-logs"))
    yield launcher
    launcher.stop_all(timeout=10)


@pytest.fixture(scope="module")
def kvstore(launcher: Launcher) -> ServiceProcess:
    return start_kvstore(launcher, "kvstore", args=["--capacity", "64MiB"])


def _config(model_dir: Path, store: str | None, **kw: object) -> EngineConfig:
    queue = kw.pop("kv_save_queue_blocks", 256)
    assert isinstance(queue, int)
    args: dict[str, object] = {
        "model_path": str(model_dir),
        "dtype": "float32",
        "block_size": BLOCK,
        "kv_cache_memory_bytes": 1 << 21,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 8,
        "max_model_len": 128,
        "kv_store": None if store is None else KVStoreConnection(store, queue),
        **kw,
    }
    return EngineConfig(**args)  # type: ignore[arg-type]


def _runner(model_dir: Path, store: str | None, layout: str = HND, **kw: object) -> ModelRunner:
    platform = NhdCpuPlatform() if layout == NHD else None
    runner = ModelRunner(_config(model_dir, store, **kw), platform=platform)
    assert runner.platform.ops.kv_layout == layout
    return runner


def chain_hashes(tokens: Sequence[int], salt: str = "") -> list[bytes]:
    """Chained content hashes of the full blocks (as the scheduler's are: each covers its whole prefix)."""
    hashes: list[bytes] = []
    previous = salt.encode()
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        previous = hashlib.sha256(previous + repr(tokens[start : start + BLOCK]).encode()).digest()
        hashes.append(previous)
    return hashes


def refs(block_ids: Sequence[int], hashes: Sequence[bytes]) -> list[worker_pb2.KVBlockRef]:
    return [worker_pb2.KVBlockRef(block_id=b, block_hash=h) for b, h in zip(block_ids, hashes, strict=True)]


class Executor:
    """What the tests drive: a ModelRunner, or rank 0 of a TP group."""

    def __init__(self, target: ModelRunner | RankDriver) -> None:
        self.target = target
        self.step_id = 0
        self.loads_done: dict[int, int] = {}
        self.dropped = 0

    def step(self, **fields: object) -> worker_pb2.StepResult:
        self.step_id += 1
        result = self.target.execute(worker_pb2.Step(step_id=self.step_id, **fields))  # type: ignore[arg-type]
        assert not result.error, result.error
        for done in result.kv_loads_done:
            assert done.load_id not in self.loads_done, "a load reported twice"
            self.loads_done[done.load_id] = done.num_loaded
        self.dropped += result.kv_saves_dropped
        return result

    def wait_load(self, load_id: int) -> int:
        """Poll with empty steps (as the scheduler does) until the load is reported; its num_loaded."""
        deadline = time.monotonic() + WAIT_S
        while load_id not in self.loads_done:
            assert time.monotonic() < deadline, f"load {load_id} not reported within {WAIT_S}s"
            self.step()
        return self.loads_done[load_id]

    def generate(
        self, rid: str, prompt: list[int], blocks: list[int], *, computed: int = 0, saves: Sequence[bytes] = ()
    ) -> list[int]:
        """Greedy-decode MAX_NEW tokens after the prompt (whose first `computed` tokens are in the cache);
        the prefill step saves the full blocks whose hashes are given."""
        needed = -(-(len(prompt) + MAX_NEW) // BLOCK)
        assert len(blocks) >= needed
        new = worker_pb2.NewRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=GREEDY,
            block_ids=blocks[:needed],
            num_computed_tokens=computed,
            num_scheduled_tokens=len(prompt) - computed,
        )
        result = self.step(new_requests=[new], kv_saves=refs(blocks[: len(saves)], saves))
        outputs = [result.sampled[0].token_id]
        while len(outputs) < MAX_NEW:
            scheduled = worker_pb2.ScheduledRequest(
                request_id=rid, num_computed_tokens=len(prompt) + len(outputs) - 1, num_scheduled_tokens=1
            )
            outputs.append(self.step(scheduled=[scheduled]).sampled[0].token_id)
        self.step(removed_request_ids=[rid])
        return outputs


def _lookup(address: str, kv_format: str, hashes: Sequence[bytes]) -> int:
    with grpc.insecure_channel(address) as channel:
        request = kvstore_pb2.LookupRequest(kv_format=kv_format, block_hashes=hashes)
        return int(kvstore_pb2_grpc.KVBlockStoreStub(channel).Lookup(request, timeout=10).num_present)


def _wait_stored(address: str, kv_format: str, hashes: Sequence[bytes]) -> None:
    """Saves run behind the steps: poll the store until it holds the whole chain."""
    deadline = time.monotonic() + WAIT_S
    while _lookup(address, kv_format, hashes) < len(hashes):
        assert time.monotonic() < deadline, "the saved blocks never reached the store"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def saved_prefix(model_dir: Path, kvstore: ServiceProcess) -> tuple[list[int], list[bytes], torch.Tensor, str]:
    """A TP=1 HND runner's prefill of PROMPT, its full blocks saved: (its greedy output, the hashes, the
    blocks' canonical slices, the kv_format)."""
    runner = _runner(model_dir, kvstore.address)
    try:
        executor = Executor(runner)
        hashes = chain_hashes(PROMPT)
        blocks = [9, 3, 12, 1, 7]
        outputs = executor.generate("saver", PROMPT, blocks, saves=hashes)
        assert executor.dropped == 0
        _wait_stored(kvstore.address, runner.kv_format, hashes)
        slices = gather_blocks(runner.kv_cache.layers, blocks[:FULL_BLOCKS], HND)
        return outputs, hashes, slices, runner.kv_format
    finally:
        runner.close()


def test_saved_prefix_loads_into_an_nhd_runner_and_continues_the_same(
    model_dir: Path, kvstore: ServiceProcess, saved_prefix: tuple[list[int], list[bytes], torch.Tensor, str]
) -> None:
    outputs, hashes, slices, kv_format = saved_prefix
    assert outputs == transformers_greedy(model_dir, PROMPT, MAX_NEW)
    runner = _runner(model_dir, kvstore.address, layout=NHD)
    try:
        assert runner.kv_format == kv_format
        executor = Executor(runner)
        blocks = [20, 2, 31, 5, 17]
        executor.step(kv_loads=[worker_pb2.KVLoad(load_id=41, blocks=refs(blocks[:FULL_BLOCKS], hashes))])
        assert executor.wait_load(41) == FULL_BLOCKS
        # The blocks hold what the saver computed, converted to this cache's layout.
        assert torch.equal(gather_blocks(runner.kv_cache.layers, blocks[:FULL_BLOCKS], NHD), slices)
        loaded = executor.generate("loader", PROMPT, blocks, computed=FULL_BLOCKS * BLOCK)
        assert loaded == outputs
    finally:
        runner.close()


def test_loaded_blocks_are_what_the_continuation_reads(
    model_dir: Path, kvstore: ServiceProcess, saved_prefix: tuple[list[int], list[bytes], torch.Tensor, str]
) -> None:
    """Without the load the same request (claiming the prefix is cached) continues differently."""
    outputs, _, _, _ = saved_prefix
    runner = _runner(model_dir, kvstore.address)
    try:
        unloaded = Executor(runner).generate("liar", PROMPT, [0, 1, 2, 3, 4], computed=FULL_BLOCKS * BLOCK)
        assert unloaded != outputs
    finally:
        runner.close()


def test_load_stops_at_the_first_block_the_store_lacks(
    model_dir: Path, kvstore: ServiceProcess, saved_prefix: tuple[list[int], list[bytes], torch.Tensor, str]
) -> None:
    _, hashes, _, _ = saved_prefix
    runner = _runner(model_dir, kvstore.address)
    try:
        executor = Executor(runner)
        never_stored = hashlib.sha256(b"never stored").digest()
        chain = [hashes[0], hashes[1], never_stored, hashes[2]]
        executor.step(
            kv_loads=[
                worker_pb2.KVLoad(load_id=1, blocks=refs([4, 5, 6, 7], chain)),
                worker_pb2.KVLoad(load_id=2, blocks=refs([8], [never_stored])),
                worker_pb2.KVLoad(load_id=3, blocks=refs([9, 10], hashes[:2])),
            ]
        )
        for load_id in (1, 2, 3):
            executor.wait_load(load_id)
        assert executor.loads_done == {1: 2, 2: 0, 3: 2}
        # A store that lacks a block is no failure.
        assert runner.kv_transfer is not None and runner.kv_transfer.stats.loads_failed == 0
    finally:
        runner.close()


def test_loads_are_reported_in_order_and_steps_run_meanwhile(
    model_dir: Path, kvstore: ServiceProcess, saved_prefix: tuple[list[int], list[bytes], torch.Tensor, str]
) -> None:
    outputs, hashes, _, _ = saved_prefix
    runner = _runner(model_dir, kvstore.address)
    try:
        executor = Executor(runner)
        loads = [worker_pb2.KVLoad(load_id=i, blocks=refs([20 + i], hashes[:1])) for i in range(10, 16)]
        executor.step(kv_loads=loads)
        # A request on other blocks runs while the loads are in flight.
        assert executor.generate("busy", PROMPT, [0, 1, 2, 3, 4]) == outputs
        while len(executor.loads_done) < len(loads):
            executor.step()
        # loads_done keeps the order results reported them in.
        assert list(executor.loads_done) == [load.load_id for load in loads]
        assert all(n == 1 for n in executor.loads_done.values())
    finally:
        runner.close()


def test_store_down_loads_nothing_and_drops_saves_without_failing_steps(model_dir: Path) -> None:
    down = f"127.0.0.1:{free_port()}"
    runner = _runner(model_dir, down)
    try:
        executor = Executor(runner)
        hashes = chain_hashes(PROMPT, salt="down")
        executor.step(kv_loads=[worker_pb2.KVLoad(load_id=5, blocks=refs([1, 2, 3], hashes))])
        assert executor.wait_load(5) == 0
        outputs = executor.generate("r", PROMPT, [6, 7, 8, 9, 10], saves=hashes)
        assert outputs == transformers_greedy(model_dir, PROMPT, MAX_NEW)
        deadline = time.monotonic() + WAIT_S
        while executor.dropped < len(hashes):
            assert time.monotonic() < deadline, "saves to a store that is down were never reported dropped"
            executor.step()
            time.sleep(0.02)
        assert executor.dropped == len(hashes)
        assert runner.kv_transfer is not None and runner.kv_transfer.stats.loads_failed == 1
    finally:
        runner.close()


def test_a_full_save_queue_drops_at_once(model_dir: Path, kvstore: ServiceProcess) -> None:
    runner = _runner(model_dir, kvstore.address, kv_save_queue_blocks=1)
    try:
        executor = Executor(runner)
        hashes = chain_hashes(PROMPT, salt="queue")
        new = worker_pb2.NewRequest(
            request_id="q", prompt_token_ids=PROMPT, sampling=GREEDY, block_ids=[0, 1, 2, 3], num_scheduled_tokens=14
        )
        # Only one block fits the queue; the step does not wait for the store to take it.
        result = executor.step(new_requests=[new], kv_saves=refs([0, 1, 2], hashes))
        assert result.kv_saves_dropped >= 2
        assert len(result.sampled) == 1
    finally:
        runner.close()


def test_reset_forgets_loads(model_dir: Path, kvstore: ServiceProcess) -> None:
    runner = _runner(model_dir, kvstore.address)
    try:
        executor = Executor(runner)
        hashes = chain_hashes(PROMPT, salt="reset")
        executor.step(kv_loads=[worker_pb2.KVLoad(load_id=i, blocks=refs([i], hashes[:1])) for i in range(1, 9)])
        runner.reset()
        assert runner.kv_transfer is not None and runner.kv_transfer.num_unreported == 0
        result = executor.step()
        assert not result.kv_loads_done
        # The new stream's load ids start over and are answered.
        executor.loads_done.clear()
        executor.step(kv_loads=[worker_pb2.KVLoad(load_id=1, blocks=refs([3], hashes[:1]))])
        assert executor.wait_load(1) == 0
    finally:
        runner.close()


def test_without_a_store_loads_are_answered_empty(model_dir: Path) -> None:
    runner = _runner(model_dir, None)
    assert runner.kv_transfer is None
    result = Executor(runner).step(
        kv_loads=[worker_pb2.KVLoad(load_id=3, blocks=refs([1], chain_hashes(PROMPT)[:1]))],
        kv_saves=refs([2], chain_hashes(PROMPT)[:1]),
    )
    assert [(d.load_id, d.num_loaded) for d in result.kv_loads_done] == [(3, 0)]
    assert result.kv_saves_dropped == 1
    runner.close()


def test_tp2_group_loads_blocks_a_tp1_runner_saved(
    model_dir: Path,
    kvstore: ServiceProcess,
    saved_prefix: tuple[list[int], list[bytes], torch.Tensor, str],
    tmp_path: Path,
) -> None:
    """Each rank reads its own KV head of the TP=1 blocks; the group continues exactly like TP=1 (fp32)."""
    outputs, hashes, _, _ = saved_prefix
    config = _config(model_dir, kvstore.address, tensor_parallel_size=2, cpu_kernels="reference")
    dist = DistInit(rank=0, world_size=2, local_rank=0, init_method=f"tcp://127.0.0.1:{free_port()}")
    spec = RankSpec(config, dist, ranks_per_node=2, cpu_binding="off", log_level="info", log_format="json")
    processes = spawn_local_ranks(spec, first_rank=0)
    driver: RankDriver | None = None
    runner: ModelRunner | None = None
    try:
        runner = ModelRunner(config, dist)
        driver = RankDriver(runner, processes, threading.Event())
        assert runner.kv_transfer is not None and runner.kv_transfer.geometry.head_count == 1
        executor = Executor(driver)
        blocks = [11, 4, 8, 0, 2]
        executor.step(kv_loads=[worker_pb2.KVLoad(load_id=8, blocks=refs(blocks[:FULL_BLOCKS], hashes))])
        assert executor.wait_load(8) == FULL_BLOCKS
        assert executor.generate("tp", PROMPT, blocks, computed=FULL_BLOCKS * BLOCK) == outputs
        # Blocks the group saves (each rank its head) are whole in the store and load on TP=1.
        fresh = chain_hashes(PROMPT, salt="tp2")
        assert executor.generate("tp-save", PROMPT, [1, 3, 5, 6, 7], saves=fresh) == outputs
        _wait_stored(kvstore.address, runner.kv_format, fresh)
    finally:
        if driver is not None:
            driver.close()
        if runner is not None:
            runner.close()  # rank 0's kvstore threads and outbox, as the worker does on shutdown
        for process in processes:
            process.kill()
    single = _runner(model_dir, kvstore.address)
    try:
        executor = Executor(single)
        executor.step(kv_loads=[worker_pb2.KVLoad(load_id=1, blocks=refs([5, 6, 7], fresh))])
        assert executor.wait_load(1) == FULL_BLOCKS
        assert executor.generate("back", PROMPT, [5, 6, 7, 8, 9], computed=FULL_BLOCKS * BLOCK) == outputs
    finally:
        single.close()


# ---- what a real store never sends: checked against an in-process stand-in ----

GEOMETRY = SliceGeometry(
    num_kv_heads=2, num_layers=2, block_size=BLOCK, head_dim=8, dtype=torch.float32, head_start=0, head_count=2
)
FORMAT = "meshserve-kv1:" + "ab" * 32
STORE_SHAPE = kvstore_pb2.BlockShape(num_kv_heads=2, num_layers=2, block_size=BLOCK, head_dim=8, dtype="float32")


class TamperingStore(kvstore_pb2_grpc.KVBlockStoreServicer):
    """Serves fixed blocks for any Get, with one block's chunks altered by `tamper`."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads
        self.tamper: str = ""
        self.tamper_index = 1
        # Shared-memory segments the Puts named, in order.
        self.put_segments: list[str] = []

    def Lookup(self, request: kvstore_pb2.LookupRequest, context: grpc.ServicerContext) -> kvstore_pb2.LookupResponse:
        raise NotImplementedError

    def Put(
        self, request_iterator: Iterator[kvstore_pb2.PutChunk], context: grpc.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        headers = 0
        for chunk in request_iterator:
            headers += chunk.HasField("header")
            if chunk.HasField("shared"):
                self.put_segments.append(chunk.shared.segment)
                if self.tamper == "before-shared":
                    # A store from before PutChunk.shared sees a header and no payload.
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "data: got 0 of its payload bytes")
        if self.tamper == "stall":
            time.sleep(2)
        return kvstore_pb2.PutResponse(num_blocks_stored=headers)

    def Stats(self, request: kvstore_pb2.StatsRequest, context: grpc.ServicerContext) -> kvstore_pb2.StoreStats:
        raise NotImplementedError

    def Get(self, request: kvstore_pb2.GetRequest, context: grpc.ServicerContext) -> Iterator[kvstore_pb2.GetChunk]:
        for index, (block_hash, data) in enumerate(zip(request.block_hashes, self.payloads, strict=False)):
            header = kvstore_pb2.GetBlockHeader(
                index=index,
                block_hash=block_hash,
                shape=STORE_SHAPE,
                head_start=request.head_start,
                head_count=request.head_count,
                payload_length=len(data),
                checksum=xxhash.xxh3_64_intdigest(data),
            )
            body = data
            if index == self.tamper_index:
                if self.tamper == "checksum":
                    body = bytes([data[0] ^ 1]) + data[1:]
                elif self.tamper == "shape":
                    header.shape.head_dim = 16
                elif self.tamper == "hash":
                    header.block_hash = hashlib.sha256(b"other").digest()
                elif self.tamper == "truncate":
                    yield kvstore_pb2.GetChunk(header=header, data=data[:10])
                    return
                elif self.tamper == "stall":
                    time.sleep(2)
            half = len(body) // 2
            yield kvstore_pb2.GetChunk(header=header, data=body[:half])
            yield kvstore_pb2.GetChunk(data=body[half:])


@pytest.fixture
def tampering() -> Iterator[tuple[TamperingStore, str, list[bytes]]]:
    source = KVCache.allocate(
        num_blocks=4,
        num_layers=2,
        block_size=BLOCK,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layout=HND,
    )
    for k, v in source.layers:
        k.normal_()
        v.normal_()
    slices = gather_blocks(source.layers, [0, 1, 2], HND)
    payloads = [slices[i].numpy().tobytes() for i in range(3)]
    store = TamperingStore(payloads)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    kvstore_pb2_grpc.add_KVBlockStoreServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield store, f"127.0.0.1:{port}", payloads
    server.stop(0)


def _transfer(address: str, get_timeout_s: float, shared_memory: bool = True) -> tuple[KVTransfer, KVCache]:
    cache = KVCache.allocate(
        num_blocks=4,
        num_layers=2,
        block_size=BLOCK,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layout=NHD,
    )
    return KVTransfer(
        address,
        FORMAT,
        GEOMETRY,
        cache.layers,
        NHD,
        CpuPlatform(),
        save_queue_blocks=8,
        get_timeout_s=get_timeout_s,
        shared_memory=shared_memory,
    ), cache


def _load(transfer: KVTransfer, load_id: int = 1) -> int:
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    transfer.submit_loads([worker_pb2.KVLoad(load_id=load_id, blocks=refs([3, 0, 2], hashes))])
    deadline = time.monotonic() + WAIT_S
    while not transfer.finished():
        assert time.monotonic() < deadline
        transfer.wait_oldest(0.05)
    [(done_id, num_loaded)] = transfer.finished()
    transfer.pop_finished(1)
    assert done_id == load_id
    return num_loaded


@pytest.mark.parametrize("tamper", ["checksum", "shape", "hash", "truncate", "stall"])
def test_a_bad_block_ends_the_load_before_it(tampering: tuple[TamperingStore, str, list[bytes]], tamper: str) -> None:
    store, address, payloads = tampering
    store.tamper = tamper
    transfer, cache = _transfer(address, get_timeout_s=1.0)
    try:
        assert _load(transfer) == 1
        # Block 0 of the load (cache block 3) holds the first payload; the bad one was not written.
        assert gather_blocks(cache.layers, [3], NHD)[0].numpy().tobytes() == payloads[0]
        assert not cache.layers[0][0][0].any()
        assert transfer.stats.loads_failed == 1
        if tamper != "stall":
            assert transfer.stats.corrupt_slices == 1
        store.tamper = ""
        assert _load(transfer, load_id=2) == 3
    finally:
        transfer.close()


def _outbox_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(SEGMENT_PREFIX + "*")}


@pytest.mark.parametrize("store_reads_shared_memory", [True, False])
def test_saves_go_through_shared_memory_or_fall_back_to_bytes(
    launcher: Launcher, kvstore: ServiceProcess, store_reads_shared_memory: bool
) -> None:
    address = kvstore.address
    if not store_reads_shared_memory:
        address = start_kvstore(launcher, "kvstore-no-shm", args=["--no-shared-memory"]).address
    before = _outbox_segments()
    saver, saved_cache = _transfer(address, get_timeout_s=10.0)
    loader, loaded_cache = _transfer(address, get_timeout_s=10.0, shared_memory=False)
    try:
        [segment] = _outbox_segments() - before
        for k, v in saved_cache.layers:
            k.copy_(torch.randn_like(k))
            v.copy_(torch.randn_like(v))
        hashes = [hashlib.sha256(f"shm fallback {store_reads_shared_memory} {i}".encode()).digest() for i in range(4)]
        saver.save(refs([0, 1, 2, 3], hashes))
        deadline = time.monotonic() + WAIT_S
        while saver.stats.blocks_saved < 4:
            assert time.monotonic() < deadline and not saver.stats.saves_dropped, saver.stats
            time.sleep(0.02)
        # A store that cannot read the outbox said so once; the same Put went again with the bytes.
        assert saver.shares_memory is store_reads_shared_memory
        assert (segment in _outbox_segments()) is store_reads_shared_memory
        loader.submit_loads([worker_pb2.KVLoad(load_id=1, blocks=refs([3, 2, 1, 0], hashes))])
        while not loader.finished():
            assert time.monotonic() < deadline
            loader.wait_oldest(0.05)
        assert loader.finished() == [(1, 4)]
        assert torch.equal(
            gather_blocks(loaded_cache.layers, [3, 2, 1, 0], NHD), gather_blocks(saved_cache.layers, [0, 1, 2, 3], NHD)
        )
    finally:
        saver.close()
        loader.close()
    # Closing unlinks the segment (a killed worker's is swept by the next one).
    assert segment not in _outbox_segments()


def test_a_put_given_up_on_leaves_its_segment_to_the_store_and_takes_a_new_one(
    tampering: tuple[TamperingStore, str, list[bytes]],
) -> None:
    store, address, _ = tampering
    store.tamper = "stall"
    cache = KVCache.allocate(
        num_blocks=4, num_layers=2, block_size=BLOCK, num_kv_heads=2, head_dim=8, dtype=torch.float32,
        device=torch.device("cpu"), layout=NHD,
    )  # fmt: skip
    transfer = KVTransfer(
        address, FORMAT, GEOMETRY, cache.layers, NHD, CpuPlatform(), save_queue_blocks=8, put_timeout_s=0.3
    )
    try:
        hashes = [hashlib.sha256(f"stalled put {i}".encode()).digest() for i in range(2)]
        transfer.save(refs([0, 1], hashes))
        deadline = time.monotonic() + WAIT_S
        while transfer.stats.put_failures < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # The stalled store may still read the slots it was named: a later Put must not rewrite them.
        [first] = set(store.put_segments)
        assert transfer.shares_memory and first not in _outbox_segments()
        store.tamper = ""
        transfer.save(refs([2, 3], hashes))
        while transfer.stats.blocks_saved < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert set(store.put_segments) - {first} <= _outbox_segments()
        assert len(set(store.put_segments)) == 2
    finally:
        transfer.close()


def test_a_store_from_before_shared_memory_gets_the_bytes(
    tampering: tuple[TamperingStore, str, list[bytes]],
) -> None:
    store, address, _ = tampering
    store.tamper = "before-shared"
    transfer, _ = _transfer(address, get_timeout_s=10.0)
    try:
        hashes = [hashlib.sha256(f"old store {i}".encode()).digest() for i in range(3)]
        transfer.save(refs([0, 1, 2], hashes))
        deadline = time.monotonic() + WAIT_S
        while transfer.stats.blocks_saved < 3:
            assert time.monotonic() < deadline and not transfer.stats.saves_dropped, transfer.stats
            time.sleep(0.02)
        # One refused attempt, then bytes from then on: nothing dropped, nothing counted as a failure.
        assert not transfer.shares_memory and len(store.put_segments) == 1
        assert transfer.stats.put_failures == 0
    finally:
        transfer.close()


def test_worker_flags_reach_the_engine_config(model_dir: Path) -> None:
    from services.cli import _build_parser
    from services.common.settings import settings_from_args
    from services.worker.server import engine_config
    from services.worker.settings import WorkerSettings

    def config(*flags: str) -> EngineConfig:
        namespace = _build_parser().parse_args(["worker", "--model", str(model_dir), *flags])
        return engine_config(settings_from_args(WorkerSettings, namespace), "cpu")

    given = config("--kv-store", "kvstore:50054", "--kv-save-queue-blocks", "7")
    assert given.kv_store is not None
    assert given.kv_store.address == "kvstore:50054" and given.kv_store.save_queue_blocks == 7
    assert config().kv_store is None
    default = config("--kv-store", "kvstore:50054").kv_store
    assert default is not None and default.save_queue_blocks == 256 and default.shared_memory
    off = config("--kv-store", "kvstore:50054", "--no-kv-store-shared-memory").kv_store
    assert off is not None and not off.shared_memory
    with pytest.raises(ValueError, match="--kv-save-queue-blocks"):
        KVStoreConnection("kvstore:50054", save_queue_blocks=0)
    with pytest.raises(ValueError, match="--kv-store must be host:port"):
        KVStoreConnection(" ")


class _FakeLoads:
    """The part of KVTransfer the TP agreement reads: one rank's finished loads and drops."""

    def __init__(self, finished: list[tuple[int, int]], owed: int, dropped: int) -> None:
        self._finished = finished
        self.num_unreported = owed
        self._dropped = dropped
        self.popped = 0

    def finished(self) -> list[tuple[int, int]]:
        return list(self._finished)

    def take_dropped(self) -> int:
        return self._dropped

    def pop_finished(self, count: int) -> None:
        self.popped = count


class _TwoRanks:
    """A TP group of two whose other rank's vector is given: min_ints is the element-wise min."""

    size = 2

    def __init__(self, other: list[int]) -> None:
        self.other = other

    def min_ints(self, values: list[int]) -> list[int]:
        assert len(values) == len(self.other), "every rank must pass a vector of the same length"
        return [min(a, b) for a, b in zip(values, self.other, strict=True)]


def test_tp_ranks_report_loads_done_on_all_of_them_with_the_fewest_blocks() -> None:
    # Rank 0 finished loads 7 (3 blocks) and 8 (2); rank 1 finished 7 with 1 block and not 8; 9 is done nowhere.
    # Rank 1's vector: [1, not done, not done, -drops].
    here = _FakeLoads([(7, 3), (8, 2)], owed=3, dropped=1)
    runner = SimpleNamespace(ranks=_TwoRanks([1, -1, -1, -4]))
    result = worker_pb2.StepResult()
    ModelRunner._report_kv(runner, here, result)  # type: ignore[arg-type]
    assert [(d.load_id, d.num_loaded) for d in result.kv_loads_done] == [(7, 1)]
    assert here.popped == 1
    # The most any rank dropped.
    assert result.kv_saves_dropped == 4
