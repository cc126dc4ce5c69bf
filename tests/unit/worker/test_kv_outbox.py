"""The worker's shared-memory outbox: slots, ranges, its file, and the sweep of dead workers' segments."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import pytest

from services.common.kv_shared_memory import is_segment_name, new_segment_name
from services.common.kv_store_limits import MAX_CHUNK_BYTES
from services.worker import kv_outbox
from services.worker.kv_outbox import KVOutbox, sweep_orphans


def test_a_slot_holds_the_payload_and_is_named_in_ranges_of_at_most_a_chunk(tmp_path: Path) -> None:
    slot = MAX_CHUNK_BYTES * 2 + 100
    box = KVOutbox(slot, 3, directory=tmp_path)
    try:
        assert is_segment_name(box.name) and box.path == tmp_path / box.name
        info = os.stat(box.path)
        # Only this user may read what a worker saves; the space is reserved up front.
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == 3 * slot
        data = os.urandom(slot)
        ranges = box.write(2, memoryview(data))
        assert [(r.segment, r.offset, r.length) for r in ranges] == [
            (box.name, 2 * slot, MAX_CHUNK_BYTES),
            (box.name, 2 * slot + MAX_CHUNK_BYTES, MAX_CHUNK_BYTES),
            (box.name, 2 * slot + 2 * MAX_CHUNK_BYTES, 100),
        ]
        on_disk = box.path.read_bytes()
        assert on_disk[2 * slot :] == data and not any(on_disk[: 2 * slot])
        # A shorter payload takes the front of its slot.
        assert [(r.offset, r.length) for r in box.write(0, memoryview(b"abc"))] == [(0, 3)]
        with pytest.raises(IndexError):
            box.write(3, memoryview(b"x"))
        with pytest.raises(ValueError, match="in a slot of"):
            box.write(0, memoryview(bytes(slot + 1)))
    finally:
        box.close()
    assert not box.path.exists()
    box.close()  # idempotent


def test_the_outbox_takes_at_most_its_byte_budget_and_at_least_one_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_outbox, "OUTBOX_MAX_BYTES", 10_000)
    small = KVOutbox(1_000, 64, directory=tmp_path)
    big = KVOutbox(50_000, 64, directory=tmp_path)
    try:
        assert small.num_slots == 10 and big.num_slots == 1
    finally:
        small.close()
        big.close()
    with pytest.raises(ValueError):
        KVOutbox(0, 4, directory=tmp_path)


def test_the_sweep_removes_dead_workers_segments_and_keeps_live_ones(tmp_path: Path) -> None:
    live = KVOutbox(4096, 2, directory=tmp_path)
    # A killed worker's segment: nobody holds its lock.
    orphan = tmp_path / new_segment_name()
    orphan.write_bytes(b"old")
    # One a worker was killed while making (before renaming it to its name).
    half_made = tmp_path / f".{new_segment_name()}.new"
    half_made.write_bytes(b"")
    # Files that are not segments, and a segment some other process holds locked, stay.
    other = tmp_path / "meshserve-kv-not-hex"
    other.write_bytes(b"x")
    fifo = tmp_path / new_segment_name()
    os.mkfifo(fifo)
    held_name = tmp_path / new_segment_name()
    held_name.write_bytes(b"y")
    fd = os.open(held_name, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # flock locks belong to an open file, so the sweep's own open of a held segment finds it locked,
        # as another worker's sweep would.
        assert sweep_orphans(tmp_path) == 2
        assert not orphan.exists() and not half_made.exists()
        assert live.path.exists() and other.exists() and held_name.exists()
        # A new outbox sweeps too, and the live one is still readable by name.
        newer = KVOutbox(4096, 1, directory=tmp_path)
        newer.close()
        assert live.path.exists() and held_name.exists()
    finally:
        os.close(fd)
        live.close()
    assert sweep_orphans(tmp_path) == 1  # the unlocked one now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["meshserve-kv-not-hex", fifo.name])
