"""One stored block as one self-describing, immutable value: a header that says what it is, then the payload.

A value read back is trusted only after every check passes: the store shares one backend between
replicas and keeps blocks for a long time, so a value may be cut short (a failed write, maxmemory),
written by another version, stored under the wrong key, or have flipped bits. Each failure has one
reason from a closed set; the caller deletes the value and counts it under that reason.

Layout (little-endian), version 1:

    magic         8 bytes   b"MSKVBLK1"
    version       u16
    num_kv_heads  u32, num_layers u32, block_size u32, head_dim u32
    payload_len   u64       bytes of payload after the header
    checksum      u64       xxh3-64 of the payload
    block_hash    32 bytes
    dtype         u8 length + ASCII
    layout        u8 length + ASCII ("head-major-v1")
    kv_format     u16 length + ASCII
    payload       payload_len bytes, [num_kv_heads][num_layers][2][block_size][head_dim]

The checksum covers the payload only, so a whole-block Get can hand it to the reader as the slice's
checksum without hashing twice; every header field is checked against what the reader expects.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Final, Literal

import xxhash

from services.common.kv_store_limits import BLOCK_HASH_BYTES, DTYPE_BYTES
from services.kvstore.backend import Buffer

MAGIC: Final = b"MSKVBLK1"
FORMAT_VERSION: Final = 1
LAYOUT: Final = "head-major-v1"

RejectReason = Literal["magic", "version", "truncated", "length", "checksum", "hash", "format", "shape"]
REJECT_REASONS: Final[tuple[RejectReason, ...]] = (
    "magic",
    "version",
    "truncated",
    "length",
    "checksum",
    "hash",
    "format",
    "shape",
)

_PREAMBLE = struct.Struct("<8sH")
_FIXED = struct.Struct(f"<8sHIIIIQQ{BLOCK_HASH_BYTES}s")
# Where the payload-length field sits, for tools (and tests) that inspect stored values.
PAYLOAD_LENGTH_OFFSET: Final = struct.calcsize("<8sHIIII")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")


@dataclass(frozen=True)
class BlockShape:
    """A whole block's shape in the canonical head-major layout."""

    num_kv_heads: int
    num_layers: int
    block_size: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_head(self) -> int:
        """Payload bytes of one KV head (all layers, K and V)."""
        return self.num_layers * 2 * self.block_size * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def payload_bytes(self) -> int:
        """Payload bytes of the whole block."""
        return self.num_kv_heads * self.bytes_per_head

    def problem(self) -> str | None:
        """Why this shape cannot describe a block (a dimension < 1, an unknown dtype), or None."""
        for name in ("num_kv_heads", "num_layers", "block_size", "head_dim"):
            if getattr(self, name) < 1:
                return f"{name} must be >= 1"
        if self.dtype not in DTYPE_BYTES:
            return f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}"
        return None

    def to_json(self) -> bytes:
        """The shape as a small JSON record (what the Redis format registry holds, readable by operators)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> BlockShape:
        """The inverse of to_json; ValueError if the record is not a shape."""
        try:
            fields = json.loads(data)
            shape = cls(
                num_kv_heads=int(fields["num_kv_heads"]),
                num_layers=int(fields["num_layers"]),
                block_size=int(fields["block_size"]),
                head_dim=int(fields["head_dim"]),
                dtype=str(fields["dtype"]),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"not a block shape record: {data[:200]!r}") from err
        if (problem := shape.problem()) is not None:
            raise ValueError(f"not a block shape record: {problem}")
        return shape


@dataclass(frozen=True)
class Block:
    """A value that passed every check; payload is a view into the value (no copy)."""

    kv_format: str
    block_hash: bytes
    shape: BlockShape
    checksum: int
    payload: memoryview


@dataclass(frozen=True)
class Rejection:
    """A value that failed a check: a miss, to be deleted and counted under reason."""

    reason: RejectReason
    detail: str


def checksum(parts: Sequence[Buffer]) -> int:
    """xxh3-64 of the concatenation of parts."""
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def encode_parts(kv_format: str, block_hash: bytes, shape: BlockShape, payload_parts: Sequence[Buffer]) -> list[Buffer]:
    """The stored value of one block as its header followed by payload_parts (no copy of the payload)."""
    payload_len = sum(len(p) for p in payload_parts)
    if (problem := shape.problem()) is not None:
        raise ValueError(problem)
    if payload_len != shape.payload_bytes:
        raise ValueError(f"payload is {payload_len} bytes; the shape needs {shape.payload_bytes}")
    if len(block_hash) != BLOCK_HASH_BYTES:
        raise ValueError(f"block_hash is {len(block_hash)} bytes; it must be {BLOCK_HASH_BYTES}")
    fmt = kv_format.encode("ascii")
    dtype = shape.dtype.encode("ascii")
    layout = LAYOUT.encode("ascii")
    header = b"".join(
        (
            _FIXED.pack(
                MAGIC,
                FORMAT_VERSION,
                shape.num_kv_heads,
                shape.num_layers,
                shape.block_size,
                shape.head_dim,
                payload_len,
                checksum(payload_parts),
                block_hash,
            ),
            _U8.pack(len(dtype)),
            dtype,
            _U8.pack(len(layout)),
            layout,
            _U16.pack(len(fmt)),
            fmt,
        )
    )
    return [header, *payload_parts]


def encode(kv_format: str, block_hash: bytes, shape: BlockShape, payload_parts: Sequence[Buffer]) -> bytes:
    """The stored value of one block in one buffer of its own (one copy of the payload)."""
    return b"".join(encode_parts(kv_format, block_hash, shape, payload_parts))


def _string(view: memoryview, offset: int, size: struct.Struct) -> tuple[str, int] | None:
    """A length-prefixed ASCII string at offset and the offset after it; None if the value ends first."""
    if offset + size.size > len(view):
        return None
    (length,) = size.unpack_from(view, offset)
    start = offset + size.size
    if start + length > len(view):
        return None
    return bytes(view[start : start + length]).decode("ascii", errors="replace"), start + length


def _strings(view: memoryview) -> tuple[str, str, str, int] | None:
    """dtype, layout, kv_format and where the payload starts; None if the header is cut short."""
    dtype = _string(view, _FIXED.size, _U8)
    if dtype is None:
        return None
    layout = _string(view, dtype[1], _U8)
    if layout is None:
        return None
    kv_format = _string(view, layout[1], _U16)
    if kv_format is None:
        return None
    return dtype[0], layout[0], kv_format[0], kv_format[1]


def decode(
    value: Buffer,
    expected_kv_format: str,
    expected_hash: bytes,
    expected_shape: BlockShape | None = None,
) -> Block | Rejection:
    """The block in value if it is whole, intact and the one asked for; otherwise why not."""
    view = memoryview(value)
    if len(view) < _PREAMBLE.size:
        if bytes(view) != MAGIC[: len(view)]:
            return Rejection("magic", "not a meshserve KV block")
        return Rejection("truncated", f"value ends after {len(view)} bytes, inside its header")
    magic, version = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        return Rejection("magic", "not a meshserve KV block")
    if version != FORMAT_VERSION:
        return Rejection("version", f"block format version {version}; this store reads {FORMAT_VERSION}")
    if len(view) < _FIXED.size:
        return Rejection("truncated", f"value ends after {len(view)} bytes, inside its header")
    _, _, heads, layers, block_size, head_dim, payload_len, stored_checksum, block_hash = _FIXED.unpack_from(view)
    strings = _strings(view)
    if strings is None:
        return Rejection("truncated", f"value ends after {len(view)} bytes, inside its header")
    dtype, layout, kv_format, payload_start = strings
    if kv_format != expected_kv_format:
        return Rejection("format", f"value holds kv_format {kv_format[:100]!r}")
    if block_hash != expected_hash:
        return Rejection("hash", f"value holds block {block_hash.hex()}")
    shape = BlockShape(heads, layers, block_size, head_dim, dtype)
    if layout != LAYOUT:
        return Rejection("shape", f"layout {layout[:100]!r}; this store reads {LAYOUT}")
    if (problem := shape.problem()) is not None:
        return Rejection("shape", problem)
    if expected_shape is not None and shape != expected_shape:
        return Rejection("shape", f"shape {shape} differs from the kv_format's {expected_shape}")
    if payload_len != shape.payload_bytes:
        return Rejection("length", f"header says {payload_len} payload bytes; its shape needs {shape.payload_bytes}")
    payload = view[payload_start:]
    if len(payload) < payload_len:
        return Rejection("truncated", f"payload ends after {len(payload)} of {payload_len} bytes")
    if len(payload) > payload_len:
        return Rejection("length", f"{len(payload)} payload bytes follow a header that says {payload_len}")
    if checksum((payload,)) != stored_checksum:
        return Rejection("checksum", "payload does not match its xxh3-64 checksum")
    return Block(kv_format, bytes(block_hash), shape, stored_checksum, payload)
