"""One rank's traffic with the kvstore: loads of KV blocks into the cache and saves out of it, off the step path.

Two daemon threads per rank, each with the rank's own sync gRPC channel (grpc reconnects by itself when
the store comes back):

- loads: KVLoads run one at a time in the order the steps sent them. Each is one Get of this rank's heads
  of the blocks; every block is checked (index, hash, shape, length, xxh3-64) before it is written into
  the cache, and a load ends at the first block that is missing, fails a check, or does not arrive in
  time. `num_loaded` is the leading blocks verified and written. Nothing here raises into a step.
- saves: the model thread copies a step's saved blocks (this rank's heads) to CPU bytes right after the
  step, while no later step can have reused them, and queues them; the save thread streams them to the
  store in Puts of several blocks, gathered over several steps (SAVE_LINGER_S; a step can ask for them
  to go at once, Step.kv_saves_flush). A full queue or an unreachable store drops blocks (counted), never
  stalls a step. A store on the same host reads the blocks' bytes from this rank's shared-memory outbox
  (kv_outbox.py) and the Put carries only where they are; a store that cannot (another host, another
  user) says so once, and from then on the bytes go in the Put.

The scheduler reserves a load's blocks until the load is reported done, so writing them from the load
thread while the model thread runs other steps touches no memory a step reads or writes. On a device the
writes go on a side stream that is synchronised before the load counts as done.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
import torch
import xxhash

from services.common.channels import open_sync_channel
from services.common.kv_store_limits import BLOCK_HASH_BYTES, MAX_BLOCK_HASHES, MAX_CHUNK_BYTES
from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2
from services.common.tls import Security
from services.worker.kv_blocks import (
    SliceGeometry,
    gather_blocks,
    scatter_blocks,
    slice_bytes,
    slices_from_bytes,
    stacked_view,
)
from services.worker.kv_outbox import KVOutbox
from services.worker.platforms.base import Platform

log = structlog.get_logger()

# A Get of one load's blocks must finish within this; a store that stalls ends the load, and the scheduler
# recomputes what did not arrive.
GET_TIMEOUT_S = 10.0
# One Put stream of up to PUT_BATCH_BLOCKS blocks.
PUT_TIMEOUT_S = 30.0
# Blocks per Put stream: amortises the stream's setup without holding many blocks in one failing call.
PUT_BATCH_BLOCKS = 64
# How long the oldest queued save waits for more before its Put starts (unless PUT_BATCH_BLOCKS are queued
# sooner, or a step asks for a flush). A decode step completes a block or two, and each Put costs both sides
# a fixed share of CPU on the cores the forward runs on: a SmolLM2 store spent ~1.6 ms a block with one Put a
# step and ~0.7 ms gathering 0.3 s of steps (docs/benchmarks.md, issue 15's tenth step). A save is only ever
# a later cache hit, so the delay costs nothing but, after a worker's death, the last quarter second of
# saves; a swapped-out request, which resumes from its saves, has the scheduler flush them at once
# (Step.kv_saves_flush).
SAVE_LINGER_S = 0.25
# Verified blocks written into the cache together: one index_copy_ per layer for all of them.
SCATTER_BATCH_BYTES = 32 * 1024 * 1024
# A Put that named shared memory and ended with one of these is sent again with the bytes, and so is every
# later one: FAILED_PRECONDITION is a store that cannot read the segment; INVALID_ARGUMENT, OUT_OF_RANGE and
# UNIMPLEMENTED are what a store older than PutChunk.shared answers (it ignores the field and finds each
# slice short), in a rolling upgrade that reaches the workers first.
REFUSED_SHARED_MEMORY = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
# How long closing waits for each thread (a Get in flight is cancelled first).
JOIN_TIMEOUT_S = 5.0


# Nice value of the save thread: saves are background work that must take CPU time from the model thread
# only when it leaves some (on a CPU host the two share the same cores).
SAVE_THREAD_NICENESS = 10


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is a schedulable task); no-op elsewhere."""
    if not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAVE_THREAD_NICENESS)
    except OSError as err:
        log.debug("kv_save_priority_unchanged", error=str(err))


class CorruptSlice(ValueError):
    """A block from the store failed a check: the load ends before it."""


@dataclass(frozen=True)
class _Save:
    """One block queued for the store: its hash and its slice (row `index` of a gathered CPU tensor)."""

    block_hash: bytes
    slices: torch.Tensor
    index: int
    # time.monotonic() when it was queued.
    queued_at: float


@dataclass
class TransferStats:
    """Counters since start, for logs and tests."""

    loads_done: int = 0
    blocks_loaded: int = 0
    # Loads that ended early on an error (store unreachable, deadline, corrupt block); a block the store
    # simply does not have is not one.
    loads_failed: int = 0
    corrupt_slices: int = 0
    blocks_saved: int = 0
    saves_dropped: int = 0
    put_failures: int = 0
    errors: list[str] = field(default_factory=list)


class KVTransfer:
    """Loads and saves of one rank's KV heads through the kvstore at `address`."""

    def __init__(
        self,
        address: str,
        kv_format: str,
        geometry: SliceGeometry,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        layout: str,
        platform: Platform,
        *,
        save_queue_blocks: int,
        rank: int = 0,
        get_timeout_s: float = GET_TIMEOUT_S,
        put_timeout_s: float = PUT_TIMEOUT_S,
        save_linger_s: float = SAVE_LINGER_S,
        security: Security | None = None,
        shared_memory: bool = True,
    ) -> None:
        """shared_memory: hand saved blocks to the store through a shared-memory outbox where it can read it."""
        if save_queue_blocks < 1:
            raise ValueError(f"--kv-save-queue-blocks must be >= 1, got {save_queue_blocks}")
        self.address = address
        self.kv_format = kv_format
        self.geometry = geometry
        self.layers = layers
        self.layout = layout
        # Found once: every save's gather and every load's scatter use it (None: a cache per layer).
        self._stacked = stacked_view(layers, layout) if layers else None
        self.num_blocks = layers[0][0].shape[0] if layers else 0
        self.save_queue_blocks = save_queue_blocks
        self.rank = rank
        self.get_timeout_s = get_timeout_s
        self.put_timeout_s = put_timeout_s
        self.save_linger_s = save_linger_s
        self.stats = TransferStats()
        self._platform = platform
        self._shape = kvstore_pb2.BlockShape(
            num_kv_heads=geometry.num_kv_heads,
            num_layers=geometry.num_layers,
            block_size=geometry.block_size,
            head_dim=geometry.head_dim,
            dtype=geometry.dtype_name,
        )
        # TLS and internal token as the worker's settings say (security None: insecure).
        self._channel = open_sync_channel(address, security)
        self._stub = kvstore_pb2_grpc.KVBlockStoreStub(self._channel)
        # One lock for both queues; the conditions say which side changed.
        self._lock = threading.Lock()
        self._loads_changed = threading.Condition(self._lock)
        self._saves_changed = threading.Condition(self._lock)
        self._closed = False
        # Loads: queued -> in progress (at most one) -> finished -> reported (popped by the model thread).
        self._queued: collections.deque[worker_pb2.KVLoad] = collections.deque()
        self._in_progress = False
        self._current_call: grpc.RpcContext | None = None
        self._finished: list[tuple[int, int]] = []
        # Submitted and not yet popped; the same on every rank, which the TP agreement relies on.
        self._unreported = 0
        # Bumped by reset(): a load that was running then is not reported to the next scheduler stream.
        self._generation = 0
        # Saves: queued blocks, counting those in a Put now, so queued memory stays bounded.
        self._saves: collections.deque[_Save] = collections.deque()
        self._saves_held = 0
        # Saves queued and taken into Puts since start; a flush sends every save queued before it at once.
        self._saves_queued = 0
        self._saves_taken = 0
        self._flush_through = 0
        self._dropped_unreported = 0
        self._store_down = False
        # Owned by the save thread from here on; None: every payload goes in data.
        self._outbox = self._open_outbox() if shared_memory else None
        self._load_thread = threading.Thread(target=self._load_loop, name=f"kv-load-{rank}", daemon=True)
        self._save_thread = threading.Thread(target=self._save_loop, name=f"kv-save-{rank}", daemon=True)
        self._load_thread.start()
        self._save_thread.start()

    # ---- model thread: loads ----

    def submit_loads(self, loads: Sequence[worker_pb2.KVLoad]) -> None:
        """Queue loads behind those already queued; returns at once."""
        if not loads:
            return
        copies = []
        for load in loads:
            # Copied: the caller may reuse the Step message.
            copy = worker_pb2.KVLoad()
            copy.CopyFrom(load)
            copies.append(copy)
        with self._lock:
            self._queued.extend(copies)
            self._unreported += len(copies)
            self._loads_changed.notify_all()

    @property
    def num_unreported(self) -> int:
        """Loads submitted and not yet popped as reported (finished or not)."""
        with self._lock:
            return self._unreported

    def finished(self) -> list[tuple[int, int]]:
        """(load_id, num_loaded) of loads done on this rank and not yet popped, oldest first."""
        with self._lock:
            return list(self._finished)

    def wait_oldest(self, timeout: float) -> bool:
        """Wait up to timeout for the oldest unreported load to be done here; True when it is (or none is owed)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._unreported and not self._finished:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._loads_changed.wait(remaining)
            return True

    def pop_finished(self, count: int) -> None:
        """Forget the oldest `count` finished loads: they have been reported."""
        with self._lock:
            if count > len(self._finished):
                raise ValueError(f"popping {count} reported loads, only {len(self._finished)} are done")
            del self._finished[:count]
            self._unreported -= count

    # ---- model thread: saves ----

    def save(self, refs: Sequence[worker_pb2.KVBlockRef]) -> None:
        """Copy the blocks' slices now (a later step may overwrite them) and queue them for the store."""
        valid = [r for r in refs if self._valid_ref(r)]
        dropped = len(refs) - len(valid)
        with self._lock:
            room = max(0, self.save_queue_blocks - self._saves_held)
        # Only this thread adds to the queue, so the room can only have grown since.
        taken = valid[:room]
        dropped += len(valid) - len(taken)
        saves: list[_Save] = []
        if taken:
            try:
                with torch.inference_mode():
                    slices = gather_blocks(self.layers, [r.block_id for r in taken], self.layout, stacked=self._stacked)
                now = time.monotonic()
                saves = [_Save(bytes(r.block_hash), slices, i, now) for i, r in enumerate(taken)]
            except Exception as err:  # a save is an optimisation: it must not fail the step it follows
                self._note_error(f"gathering saves: {type(err).__name__}: {err}")
                log.exception("kv_save_gather_failed", tp_rank=self.rank, blocks=len(taken))
                dropped += len(taken)
        with self._lock:
            if saves:
                self._saves.extend(saves)
                self._saves_held += len(saves)
                self._saves_queued += len(saves)
                self._saves_changed.notify_all()
            self._count_dropped(dropped)
        if dropped:
            log.debug("kv_saves_dropped", tp_rank=self.rank, blocks=dropped, reason="queue full or bad block")

    def flush_saves(self) -> None:
        """Send every save queued so far without waiting out the linger (their request resumes from them)."""
        with self._lock:
            self._flush_through = self._saves_queued
            self._saves_changed.notify_all()

    def take_dropped(self) -> int:
        """Saves dropped since the last call."""
        with self._lock:
            dropped, self._dropped_unreported = self._dropped_unreported, 0
            return dropped

    # ---- model thread: lifetime ----

    def reset(self) -> None:
        """A new scheduler stream: drop queued loads, end the one in progress and forget every load id.

        Returns once no load thread write is in flight: the new scheduler reuses those blocks."""
        with self._lock:
            self._generation += 1
            self._queued.clear()
            self._finished.clear()
            self._unreported = 0
            if self._current_call is not None:
                self._current_call.cancel()
            while self._in_progress:
                self._loads_changed.wait()

    def close(self) -> None:
        """Stop both threads (queued saves are dropped) and close the channel."""
        with self._lock:
            self._closed = True
            if self._current_call is not None:
                self._current_call.cancel()
            self._loads_changed.notify_all()
            self._saves_changed.notify_all()
        self._load_thread.join(JOIN_TIMEOUT_S)
        self._save_thread.join(JOIN_TIMEOUT_S)
        self._channel.close()
        if self._outbox is not None and not self._save_thread.is_alive():
            self._outbox.close()

    def _valid_ref(self, ref: worker_pb2.KVBlockRef) -> bool:
        return ref.block_id < self.num_blocks and len(ref.block_hash) == BLOCK_HASH_BYTES

    def _count_dropped(self, count: int) -> None:
        """Under the lock."""
        self._dropped_unreported += count
        self.stats.saves_dropped += count

    # ---- load thread ----

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device if self.layers else torch.device("cpu")

    def _side_stream(self) -> torch.Stream | None:
        """A stream of this rank's device for the cache writes, so they overlap the model's work (None on the CPU)."""
        if self.device.type == "cpu":
            return None
        try:
            # The current device is per thread on CUDA and Ascend.
            self._platform.set_device()
            return torch.Stream(self.device)
        except Exception:
            # Still correct without one: the writes then go on the default stream, synchronised each time.
            log.exception("kv_load_stream_unavailable", tp_rank=self.rank, device=str(self.device))
            return None

    def _load_loop(self) -> None:
        stream = self._side_stream()
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._loads_changed.wait()
                if self._closed:
                    return
                load = self._queued.popleft()
                self._in_progress = True
                generation = self._generation
            num_loaded = 0
            try:
                num_loaded = self._run_load(load, generation, stream)
            except Exception as err:  # never let the thread die: later loads must still be answered
                self._note_error(f"load {load.load_id}: {type(err).__name__}: {err}")
                log.exception("kv_load_failed", tp_rank=self.rank, load_id=load.load_id)
            finally:
                with self._lock:
                    self._in_progress = False
                    self._current_call = None
                    if generation == self._generation:
                        self._finished.append((load.load_id, num_loaded))
                        self.stats.loads_done += 1
                        self.stats.blocks_loaded += num_loaded
                    self._loads_changed.notify_all()

    def _run_load(self, load: worker_pb2.KVLoad, generation: int, stream: torch.Stream | None) -> int:
        """Fetch and write the load's leading blocks; the count written."""
        blocks = list(load.blocks)
        # Only a leading run is usable: stop at the first block id or hash that cannot be right.
        usable = next((i for i, b in enumerate(blocks) if not self._valid_ref(b)), len(blocks))
        if usable < len(blocks):
            log.warning("kv_load_bad_block", tp_rank=self.rank, load_id=load.load_id, position=usable)
        loaded = 0
        for start in range(0, usable, MAX_BLOCK_HASHES):
            group = blocks[start : min(usable, start + MAX_BLOCK_HASHES)]
            got = self._fetch(load.load_id, group, generation, stream)
            loaded += got
            if got < len(group):
                break
        return loaded

    def _fetch(
        self, load_id: int, group: list[worker_pb2.KVBlockRef], generation: int, stream: torch.Stream | None
    ) -> int:
        """One Get of the group's blocks; writes the verified leading ones and returns how many."""
        request = kvstore_pb2.GetRequest(
            kv_format=self.kv_format,
            block_hashes=[b.block_hash for b in group],
            head_start=self.geometry.head_start,
            head_count=self.geometry.head_count,
        )
        call = self._stub.Get(request, timeout=self.get_timeout_s)
        with self._lock:
            if generation != self._generation or self._closed:
                call.cancel()
                return 0
            self._current_call = call
        written = 0
        batch: list[bytearray] = []
        per_batch = max(1, SCATTER_BATCH_BYTES // self.geometry.slice_nbytes)
        failed = False
        try:
            for payload in self._verified_slices(call, group):
                batch.append(payload)
                if len(batch) >= per_batch:
                    self._write(group[written : written + len(batch)], batch, stream)
                    written += len(batch)
                    batch = []
        except grpc.RpcError as err:
            # CANCELLED: reset() or close() ended the call; nothing went wrong.
            failed = err.code() != grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
            if failed:
                self._note_error(f"load {load_id}: Get: {err.code().name}: {err.details()}")  # type: ignore[attr-defined]
                log.warning(
                    "kv_load_interrupted",
                    tp_rank=self.rank,
                    load_id=load_id,
                    code=err.code().name,  # type: ignore[attr-defined]
                    details=err.details(),  # type: ignore[attr-defined]
                    verified=written + len(batch),
                    requested=len(group),
                )
        except CorruptSlice as err:
            failed = True
            with self._lock:
                self.stats.corrupt_slices += 1
            self._note_error(f"load {load_id}: {err}")
            log.warning("kv_load_corrupt_block", tp_rank=self.rank, load_id=load_id, error=str(err))
        finally:
            call.cancel()
        with self._lock:
            current = generation == self._generation and not self._closed
        # Blocks verified before a failure are whole and right: keep them (unless a reset gave the blocks
        # to a new scheduler stream meanwhile).
        if batch and current:
            self._write(group[written : written + len(batch)], batch, stream)
            written += len(batch)
        if failed:
            with self._lock:
                self.stats.loads_failed += 1
        return written

    def _verified_slices(
        self, chunks: Iterator[kvstore_pb2.GetChunk], group: list[worker_pb2.KVBlockRef]
    ) -> Iterator[bytearray]:
        """The payloads of the stream's blocks, each checked against what was asked; raises CorruptSlice."""
        expected_len = self.geometry.slice_nbytes
        payload: bytearray | None = None
        filled = 0
        checksum = 0
        index = 0
        for chunk in chunks:
            if chunk.HasField("header"):
                if payload is not None:
                    raise CorruptSlice(f"block {index}: a new header after {filled} of {expected_len} bytes")
                header = chunk.header
                self._check_header(header, index, group)
                payload = bytearray(expected_len)
                filled = 0
                checksum = header.checksum
            elif payload is None:
                raise CorruptSlice(f"block {index}: data before its header")
            data = chunk.data
            if filled + len(data) > expected_len:
                raise CorruptSlice(f"block {index}: more than its {expected_len} bytes")
            payload[filled : filled + len(data)] = data
            filled += len(data)
            if filled == expected_len:
                actual = xxhash.xxh3_64_intdigest(payload)
                if actual != checksum:
                    raise CorruptSlice(f"block {index}: xxh3-64 {actual:#x} != header's {checksum:#x}")
                yield payload
                payload = None
                index += 1
        if payload is not None:
            raise CorruptSlice(f"block {index}: the stream ended after {filled} of {expected_len} bytes")

    def _check_header(self, header: kvstore_pb2.GetBlockHeader, index: int, group: list[worker_pb2.KVBlockRef]) -> None:
        if header.index != index:
            raise CorruptSlice(f"header index {header.index}, expected {index}")
        if index >= len(group):
            raise CorruptSlice(f"block {index} was not asked for")
        if header.block_hash != group[index].block_hash:
            raise CorruptSlice(f"block {index}: hash {header.block_hash.hex()[:16]}... is not the one asked for")
        if header.shape != self._shape:
            raise CorruptSlice(
                f"block {index}: shape {_shape_text(header.shape)} is not this model's {_shape_text(self._shape)}"
            )
        if header.head_start != self.geometry.head_start or header.head_count != self.geometry.head_count:
            raise CorruptSlice(
                f"block {index}: heads [{header.head_start}, +{header.head_count}), expected "
                f"[{self.geometry.head_start}, +{self.geometry.head_count})"
            )
        if header.payload_length != self.geometry.slice_nbytes:
            raise CorruptSlice(
                f"block {index}: payload_length {header.payload_length}, expected {self.geometry.slice_nbytes}"
            )

    def _write(self, refs: list[worker_pb2.KVBlockRef], payloads: list[bytearray], stream: torch.Stream | None) -> None:
        """Scatter verified slices into their blocks; done (on the device too) when this returns."""
        slices = slices_from_bytes(payloads, self.geometry)
        ids = [r.block_id for r in refs]
        with torch.inference_mode():
            if stream is None:
                scatter_blocks(self.layers, ids, slices, self.layout, stacked=self._stacked)
                if self.device.type != "cpu":
                    self._platform.synchronize()
                return
            with stream:
                scatter_blocks(self.layers, ids, slices, self.layout, stacked=self._stacked)
            # Done before the load counts as done: the step that reads these blocks runs on another stream.
            stream.synchronize()

    # ---- save thread ----

    def _save_loop(self) -> None:
        _lower_priority()
        while True:
            with self._lock:
                while not self._saves and not self._closed:
                    self._saves_changed.wait()
                self._linger()
                if self._closed:
                    return
                batch = [self._saves.popleft() for _ in range(min(PUT_BATCH_BLOCKS, len(self._saves)))]
                self._saves_taken += len(batch)
            try:
                self._put(batch)
            except Exception as err:  # never let the thread die
                self._note_error(f"Put: {type(err).__name__}: {err}")
                log.exception("kv_save_failed", tp_rank=self.rank)
                with self._lock:
                    self._count_dropped(len(batch))
            finally:
                with self._lock:
                    self._saves_held -= len(batch)

    def _linger(self) -> None:
        """Under the lock: wait until the oldest queued save has waited SAVE_LINGER_S, a whole Put's worth is
        queued, a flush asks for a queued save, or the transfer closes."""
        while not self._closed and not self._flushing and 0 < len(self._saves) < PUT_BATCH_BLOCKS:
            remaining = self._saves[0].queued_at + self.save_linger_s - time.monotonic()
            if remaining <= 0:
                return
            self._saves_changed.wait(remaining)

    @property
    def _flushing(self) -> bool:
        """Under the lock: whether a save queued before the last flush is still queued."""
        return self._saves_taken < self._flush_through

    def _open_outbox(self) -> KVOutbox | None:
        try:
            return KVOutbox(self.geometry.slice_nbytes, PUT_BATCH_BLOCKS)
        except OSError as err:
            log.warning("kv_outbox_unavailable", tp_rank=self.rank, error=str(err), note="saves send their bytes")
            return None

    @property
    def shares_memory(self) -> bool:
        """Whether saves still hand their bytes over in shared memory."""
        return self._outbox is not None

    def _put(self, batch: list[_Save]) -> None:
        """One Put stream of the batch's slices; what the store could not take counts as dropped."""
        outbox = self._outbox
        # Written here, before the call: gRPC's thread that sends the chunks never touches the outbox.
        shared = self._fill_outbox(outbox, batch) if outbox is not None else []
        try:
            response = self._stub.Put(self._chunks(batch, shared), timeout=self.put_timeout_s)
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            if shared and code in REFUSED_SHARED_MEMORY:
                # The store cannot read this rank's shared memory, or (a store from before PutChunk.shared,
                # which ignores the field and finds the slice short) does not know it: the bytes go in the
                # Put from now on.
                log.warning(
                    "kv_store_shared_memory_unreadable",
                    tp_rank=self.rank,
                    address=self.address,
                    details=err.details(),  # type: ignore[attr-defined]
                    note="saves send their bytes from now on",
                )
                self._retire_outbox(replace=False)
                self._put(batch)
                return
            if shared and code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                # Given up on here, the call may still be read there: the store must never read a slot
                # that a later Put rewrites (it would store wrong bytes under a right hash), so the next
                # Put gets a new segment and this one is left to the store's mapping.
                self._retire_outbox(replace=True)
            with self._lock:
                # Blocks completed before the failure may be stored; which ones is unknown, so all count.
                self._count_dropped(len(batch))
                self.stats.put_failures += 1
                was_down, self._store_down = self._store_down, True
            if not was_down:
                self._note_error(f"Put: {code.name}: {err.details()}")  # type: ignore[attr-defined]
                log.warning(
                    "kv_store_put_failed",
                    tp_rank=self.rank,
                    address=self.address,
                    code=code.name,
                    details=err.details(),  # type: ignore[attr-defined]
                    note="saves are dropped until it answers again",
                )
            return
        with self._lock:
            self._count_dropped(response.num_blocks_dropped)
            self.stats.blocks_saved += len(batch) - response.num_blocks_dropped
            was_down, self._store_down = self._store_down, False
        if was_down:
            log.info("kv_store_put_recovered", tp_rank=self.rank, address=self.address)

    @staticmethod
    def _fill_outbox(outbox: KVOutbox, batch: list[_Save]) -> list[list[kvstore_pb2.SharedMemoryRange]]:
        """Copy the batch's first blocks into the outbox's slots (slot i: block i); their ranges, in order.

        One Put is in flight at a time and its slots are reused only after it has answered."""
        return [
            outbox.write(i, slice_bytes(save.slices, save.index)) for i, save in enumerate(batch[: outbox.num_slots])
        ]

    def _retire_outbox(self, replace: bool) -> None:
        """Close and unlink the outbox (a store's mapping of it stays valid); open a new one if replace."""
        if self._outbox is not None:
            self._outbox.close()
        self._outbox = self._open_outbox() if replace else None

    def _chunks(
        self, batch: list[_Save], shared: list[list[kvstore_pb2.SharedMemoryRange]]
    ) -> Iterator[kvstore_pb2.PutChunk]:
        """The batch's chunks: by their outbox ranges where it has them, else with the bytes."""
        for i, save in enumerate(batch):
            header = kvstore_pb2.BlockHeader(
                kv_format=self.kv_format,
                block_hash=save.block_hash,
                shape=self._shape,
                head_start=self.geometry.head_start,
                head_count=self.geometry.head_count,
            )
            if i < len(shared):
                for n, piece_range in enumerate(shared[i]):
                    yield (
                        kvstore_pb2.PutChunk(header=header, shared=piece_range)
                        if n == 0
                        else kvstore_pb2.PutChunk(shared=piece_range)
                    )
                continue
            data = slice_bytes(save.slices, save.index)
            for offset in range(0, len(data), MAX_CHUNK_BYTES):
                piece = bytes(data[offset : offset + MAX_CHUNK_BYTES])
                yield (
                    kvstore_pb2.PutChunk(header=header, data=piece) if offset == 0 else kvstore_pb2.PutChunk(data=piece)
                )

    def _note_error(self, text: str) -> None:
        with self._lock:
            # The last few, for tests and debugging; logs have them all.
            self.stats.errors = [*self.stats.errors[-9:], text]


def _shape_text(shape: kvstore_pb2.BlockShape) -> str:
    return (
        f"[{shape.num_kv_heads} heads, {shape.num_layers} layers, {shape.block_size} tokens, "
        f"{shape.head_dim} dims, {shape.dtype or '?'}]"
    )
