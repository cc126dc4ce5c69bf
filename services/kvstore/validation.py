"""Checks of what callers send, as StatusErrors that name the field and say how to fix it.

Caps come first, before any work that grows with the input: a request with a million hashes is
refused by its count, not after looking at each hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2

from services.common.errors import Reason, StatusError, invalid_argument_status, make_status
from services.common.kv_store_limits import (
    BLOCK_HASH_BYTES,
    DTYPE_BYTES,
    MAX_BLOCK_HASHES,
    MAX_BLOCK_PAYLOAD_BYTES,
    MAX_CHUNK_BYTES,
    is_valid_kv_format,
)
from services.common.proto.meshserve.v1 import kvstore_pb2
from services.kvstore.backend import block_key
from services.kvstore.block_format import BlockShape


def invalid(field: str, description: str) -> StatusError:
    """INVALID_ARGUMENT for one field."""
    return StatusError(invalid_argument_status(field, description))


def out_of_range(field: str, description: str) -> StatusError:
    """OUT_OF_RANGE (a count or size over a cap) for one field, with the same BadRequest detail."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
    return StatusError(
        make_status(
            grpc.StatusCode.OUT_OF_RANGE,
            f"{field}: {description}",
            error_details_pb2.BadRequest(field_violations=[violation]),
        )
    )


def unreadable_shared_memory(field: str, description: str) -> StatusError:
    """FAILED_PRECONDITION: a PutChunk.shared range this store cannot read; the writer sends the bytes instead."""
    failure = error_details_pb2.PreconditionFailure.Violation(
        type="SHARED_MEMORY", subject=field, description=description
    )
    return StatusError(
        make_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{field}: {description}",
            error_details_pb2.PreconditionFailure(violations=[failure]),
            reason=Reason.SHARED_MEMORY_UNREADABLE,
        )
    )


def check_kv_format(kv_format: str, field: str = "kv_format") -> None:
    """A KV format key of the one known form."""
    if not is_valid_kv_format(kv_format):
        raise invalid(
            field,
            f"{kv_format[:100]!r} is not a KV format key; it must be 'meshserve-kv1:' followed by 64 lowercase "
            "hex digits (the worker's kv_format)",
        )


def check_block_hash(block_hash: bytes, field: str) -> None:
    """A sha256 digest."""
    if len(block_hash) != BLOCK_HASH_BYTES:
        raise invalid(field, f"is {len(block_hash)} bytes; a block hash is exactly {BLOCK_HASH_BYTES} (sha256)")


def check_block_hashes(hashes: Sequence[bytes], field: str = "block_hashes") -> None:
    """At most MAX_BLOCK_HASHES hashes, each 32 bytes."""
    if len(hashes) > MAX_BLOCK_HASHES:
        raise out_of_range(field, f"{len(hashes)} hashes; at most {MAX_BLOCK_HASHES} per call (split the chain)")
    for i, block_hash in enumerate(hashes):
        check_block_hash(block_hash, f"{field}[{i}]")


def check_chunk_data(data: bytes) -> None:
    """At most MAX_CHUNK_BYTES of payload per chunk."""
    if len(data) > MAX_CHUNK_BYTES:
        raise out_of_range("data", f"{len(data)} bytes in one chunk; at most {MAX_CHUNK_BYTES} (split the payload)")


@dataclass(frozen=True)
class SliceHeader:
    """A checked BlockHeader: heads [head_start, head_start + head_count) of one block."""

    kv_format: str
    block_hash: bytes
    shape: BlockShape
    head_start: int
    head_count: int

    @property
    def key(self) -> str:
        """The block's backend key."""
        return block_key(self.kv_format, self.block_hash)

    @property
    def payload_length(self) -> int:
        """Bytes of this slice's payload."""
        return self.head_count * self.shape.bytes_per_head

    @property
    def whole(self) -> bool:
        """Whether the slice holds every head of its block."""
        return self.head_count == self.shape.num_kv_heads

    def describe(self) -> str:
        """For messages: which block and heads."""
        return f"block {self.block_hash.hex()[:16]}… heads {self.head_start}..{self.head_start + self.head_count - 1}"


def shape_to_proto(shape: BlockShape) -> kvstore_pb2.BlockShape:
    """The wire form of a checked shape (check_shape's inverse)."""
    return kvstore_pb2.BlockShape(
        num_kv_heads=shape.num_kv_heads,
        num_layers=shape.num_layers,
        block_size=shape.block_size,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
    )


def check_shape(shape: kvstore_pb2.BlockShape, field: str) -> BlockShape:
    """A block shape with every dimension >= 1, a known dtype and a payload within the cap."""
    for name in ("num_kv_heads", "num_layers", "block_size", "head_dim"):
        if getattr(shape, name) < 1:
            raise invalid(f"{field}.{name}", "must be >= 1")
    if shape.dtype not in DTYPE_BYTES:
        raise invalid(f"{field}.dtype", f"{shape.dtype[:40]!r} is not one of {', '.join(DTYPE_BYTES)}")
    checked = BlockShape(shape.num_kv_heads, shape.num_layers, shape.block_size, shape.head_dim, shape.dtype)
    if checked.payload_bytes > MAX_BLOCK_PAYLOAD_BYTES:
        raise out_of_range(
            field,
            f"a block of this shape is {checked.payload_bytes} bytes; at most {MAX_BLOCK_PAYLOAD_BYTES} "
            "(use a smaller block_size)",
        )
    return checked


def check_slice_header(header: kvstore_pb2.BlockHeader) -> SliceHeader:
    """The header of one Put slice, checked in full before any of its payload is taken."""
    check_kv_format(header.kv_format, "header.kv_format")
    check_block_hash(header.block_hash, "header.block_hash")
    if not header.HasField("shape"):
        raise invalid("header.shape", "is missing; every slice carries its whole block's shape")
    shape = check_shape(header.shape, "header.shape")
    if header.head_count < 1:
        raise invalid("header.head_count", "must be >= 1 (the heads this slice holds)")
    if header.head_start + header.head_count > shape.num_kv_heads:
        raise invalid(
            "header.head_start",
            f"heads {header.head_start}..{header.head_start + header.head_count - 1} are outside the block's "
            f"{shape.num_kv_heads} heads; head_start + head_count must be <= shape.num_kv_heads",
        )
    return SliceHeader(header.kv_format, header.block_hash, shape, header.head_start, header.head_count)


def check_get_heads(shape: BlockShape, head_start: int, head_count: int) -> tuple[int, int]:
    """The heads a Get returns of each block (head_count 0: all from head_start on)."""
    if head_start >= shape.num_kv_heads:
        raise invalid(
            "head_start",
            f"{head_start} is outside the block's {shape.num_kv_heads} heads; it must be < shape.num_kv_heads",
        )
    count = head_count or shape.num_kv_heads - head_start
    if head_start + count > shape.num_kv_heads:
        raise invalid(
            "head_count",
            f"heads {head_start}..{head_start + count - 1} are outside the block's {shape.num_kv_heads} heads; "
            "head_start + head_count must be <= shape.num_kv_heads (or head_count 0 for all the rest)",
        )
    return head_start, count
