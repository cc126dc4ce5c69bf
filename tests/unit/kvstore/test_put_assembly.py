"""Put framing: a header opens a slice, data fills it exactly; every framing error names its field."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import StatusError
from services.common.kv_store_limits import MAX_BLOCK_PAYLOAD_BYTES, MAX_CHUNK_BYTES
from services.common.proto.meshserve.v1 import kvstore_pb2
from services.kvstore.put_assembly import SliceAssembler

FMT = "meshserve-kv1:" + "ab" * 32
SHAPE = kvstore_pb2.BlockShape(num_kv_heads=2, num_layers=1, block_size=2, head_dim=4, dtype="float16")
PER_HEAD = 1 * 2 * 2 * 4 * 2  # 32 bytes


def _header(**overrides: object) -> kvstore_pb2.BlockHeader:
    fields: dict[str, object] = {
        "kv_format": FMT,
        "block_hash": b"h" * 32,
        "shape": SHAPE,
        "head_start": 0,
        "head_count": 2,
    }
    fields.update(overrides)
    return kvstore_pb2.BlockHeader(**fields)  # type: ignore[arg-type]


def _chunk(header: kvstore_pb2.BlockHeader | None = None, data: bytes = b"") -> kvstore_pb2.PutChunk:
    return kvstore_pb2.PutChunk(header=header, data=data)


def _fails(chunks: list[kvstore_pb2.PutChunk], finish: bool = False) -> tuple[grpc.StatusCode, str]:
    assembler = SliceAssembler()
    with pytest.raises(StatusError) as caught:
        for chunk in chunks:
            assembler.feed(chunk)
        if finish:
            assembler.finish()
    status = caught.value.status
    return status.code, status.details


def test_slices_in_one_or_many_chunks() -> None:
    assembler = SliceAssembler()
    opened, done = assembler.feed(_chunk(_header(), b"x" * 64))
    assert opened is not None and done is not None and done.payload() == b"x" * 64
    opened, done = assembler.feed(_chunk(_header(head_start=1, head_count=1)))
    assert opened is not None and opened.payload_length == PER_HEAD and done is None
    assert assembler.feed(_chunk(data=b"a" * 10)) == (None, None)
    opened, done = assembler.feed(_chunk(data=b"b" * 22))
    assert done is not None and done.header.head_start == 1 and done.payload() == b"a" * 10 + b"b" * 22
    assembler.finish()


@pytest.mark.parametrize(
    ("chunks", "finish", "code", "field"),
    [
        ([_chunk(data=b"x")], False, grpc.StatusCode.INVALID_ARGUMENT, "header"),
        ([_chunk(_header(), b"x" * (MAX_CHUNK_BYTES + 1))], False, grpc.StatusCode.OUT_OF_RANGE, "data"),
        ([_chunk(_header(), b"x" * 10), _chunk(_header())], False, grpc.StatusCode.INVALID_ARGUMENT, "data"),
        ([_chunk(_header(), b"x" * 10)], True, grpc.StatusCode.INVALID_ARGUMENT, "data"),
        ([_chunk(_header(), b"x" * 65)], False, grpc.StatusCode.INVALID_ARGUMENT, "data"),
        ([_chunk(_header(), b"x" * 64), _chunk(data=b"y")], False, grpc.StatusCode.INVALID_ARGUMENT, "header"),
        ([_chunk(_header(kv_format="meshserve-kv2:" + "ab" * 32))], False, grpc.StatusCode.INVALID_ARGUMENT,
         "header.kv_format"),
        ([_chunk(_header(block_hash=b"h" * 31))], False, grpc.StatusCode.INVALID_ARGUMENT, "header.block_hash"),
        ([_chunk(_header(head_start=1, head_count=2))], False, grpc.StatusCode.INVALID_ARGUMENT, "header.head_start"),
        ([_chunk(_header(head_count=0))], False, grpc.StatusCode.INVALID_ARGUMENT, "header.head_count"),
        ([_chunk(_header(shape=kvstore_pb2.BlockShape(num_kv_heads=2, num_layers=1, block_size=2, head_dim=4,
                                                      dtype="int8")))],
         False, grpc.StatusCode.INVALID_ARGUMENT, "header.shape.dtype"),
        ([_chunk(_header(shape=kvstore_pb2.BlockShape(num_kv_heads=2, num_layers=0, block_size=2, head_dim=4,
                                                      dtype="float16")))],
         False, grpc.StatusCode.INVALID_ARGUMENT, "header.shape.num_layers"),
        ([_chunk(_header(shape=kvstore_pb2.BlockShape(num_kv_heads=2, num_layers=1, block_size=1 << 20,
                                                      head_dim=1 << 10, dtype="float32")))],
         False, grpc.StatusCode.OUT_OF_RANGE, "header.shape"),
        ([kvstore_pb2.PutChunk(header=kvstore_pb2.BlockHeader(kv_format=FMT, block_hash=b"h" * 32, head_count=1))],
         False, grpc.StatusCode.INVALID_ARGUMENT, "header.shape"),
    ],
)  # fmt: skip
def test_framing_errors_name_the_field(
    chunks: list[kvstore_pb2.PutChunk], finish: bool, code: grpc.StatusCode, field: str
) -> None:
    got_code, details = _fails(chunks, finish)
    assert got_code == code
    assert details.startswith(f"{field}: ")


def test_the_payload_cap_is_checked_from_the_header() -> None:
    # 1 layer x 2 x 1024 tokens x 1024 x 4 bytes = 8 MiB a head: 33 heads pass the cap, so no data is needed
    # to be refused.
    heads = MAX_BLOCK_PAYLOAD_BYTES // (8 << 20) + 1
    shape = kvstore_pb2.BlockShape(num_kv_heads=heads, num_layers=1, block_size=1024, head_dim=1024, dtype="float32")
    code, details = _fails([_chunk(_header(shape=shape, head_count=1))])
    assert code == grpc.StatusCode.OUT_OF_RANGE and "header.shape" in details
