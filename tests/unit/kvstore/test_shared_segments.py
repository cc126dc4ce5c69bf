"""The store's reader of PutChunk.shared ranges, over segments in a scratch directory."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from services.common.errors import StatusError
from services.common.kv_shared_memory import new_segment_name
from services.common.proto.meshserve.v1 import kvstore_pb2
from services.kvstore.shared_segments import SharedSegments
from services.worker.kv_outbox import KVOutbox


def _code(err: pytest.ExceptionInfo[StatusError]) -> grpc.StatusCode:
    return err.value.status.code


def test_reads_a_range_as_a_view_and_keeps_few_segments_mapped(tmp_path: Path) -> None:
    boxes = [KVOutbox(64, 2, directory=tmp_path) for _ in range(3)]
    reader = SharedSegments(True, directory=tmp_path, max_open=2)
    try:
        for i, box in enumerate(boxes):
            box.write(1, memoryview(bytes([i]) * 64))
        for _ in range(2):  # the second round reopens what the first unmapped
            for i, box in enumerate(boxes):
                [shared] = box.write(1, memoryview(bytes([i + 10]) * 64))
                view = reader.read(shared)
                assert isinstance(view, memoryview) and bytes(view) == bytes([i + 10]) * 64
                view.release()
        assert len(reader._open) == 2
        assert reader.bytes_read == 6 * 64
    finally:
        reader.close()
        for box in boxes:
            box.close()


def test_refuses_what_it_must_not_read(tmp_path: Path) -> None:
    box = KVOutbox(64, 1, directory=tmp_path)
    link = new_segment_name()
    os.symlink(box.path, tmp_path / link)
    directory = tmp_path / "dir-segment"
    fifo = new_segment_name()
    os.mkfifo(tmp_path / fifo)
    reader = SharedSegments(True, directory=tmp_path)
    try:
        with pytest.raises(StatusError) as err:
            reader.read(kvstore_pb2.SharedMemoryRange(segment=link, length=1))
        assert _code(err) == grpc.StatusCode.FAILED_PRECONDITION and "cannot be opened" in str(err.value)
        with pytest.raises(StatusError) as err:
            reader.read(kvstore_pb2.SharedMemoryRange(segment=fifo, length=1))
        assert _code(err) == grpc.StatusCode.FAILED_PRECONDITION and "not a file of this kvstore's user" in str(
            err.value
        )
        with pytest.raises(StatusError) as err:
            reader.read(kvstore_pb2.SharedMemoryRange(segment=directory.name, length=1))
        assert _code(err) == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(StatusError) as err:
            reader.read(kvstore_pb2.SharedMemoryRange(segment=box.name, offset=60, length=5))
        assert _code(err) == grpc.StatusCode.OUT_OF_RANGE and "shared.offset" in str(err.value)
        off = SharedSegments(False, directory=tmp_path)
        with pytest.raises(StatusError) as err:
            off.read(kvstore_pb2.SharedMemoryRange(segment=box.name, length=1))
        assert _code(err) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        reader.close()
        box.close()
