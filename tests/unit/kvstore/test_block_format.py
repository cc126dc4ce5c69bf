"""A stored value decodes to exactly what was encoded, and every kind of damage is caught under its reason."""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash

from services.kvstore.block_format import (
    MAGIC,
    PAYLOAD_LENGTH_OFFSET,
    REJECT_REASONS,
    Block,
    BlockShape,
    Rejection,
    decode,
    encode,
)

FMT = "meshserve-kv1:" + "0f" * 32
OTHER_FMT = "meshserve-kv1:" + "e1" * 32
SHAPE = BlockShape(num_kv_heads=4, num_layers=3, block_size=16, head_dim=8, dtype="bfloat16")
HASH = hashlib.sha256(b"block").digest()
PAYLOAD = bytes(range(256)) * (SHAPE.payload_bytes // 256)
VERSION_AT = 8


def _value(**overrides: object) -> bytes:
    args: dict[str, object] = {"kv_format": FMT, "block_hash": HASH, "shape": SHAPE, "payload_parts": [PAYLOAD]}
    args.update(overrides)
    return encode(**args)  # type: ignore[arg-type]


def _reason(value: bytes, **expected: object) -> str:
    result = decode(value, str(expected.get("kv_format", FMT)), expected.get("block_hash", HASH), expected.get("shape"))  # type: ignore[arg-type]
    assert isinstance(result, Rejection), result
    assert result.detail
    return result.reason


def test_round_trip_from_parts() -> None:
    assert SHAPE.bytes_per_head == 3 * 2 * 16 * 8 * 2
    value = encode(FMT, HASH, SHAPE, [PAYLOAD[:1000], memoryview(PAYLOAD)[1000:]])
    assert value.startswith(MAGIC)
    block = decode(value, FMT, HASH, SHAPE)
    assert isinstance(block, Block)
    assert (block.kv_format, block.block_hash, block.shape) == (FMT, HASH, SHAPE)
    assert bytes(block.payload) == PAYLOAD
    assert block.checksum == xxhash.xxh3_64_intdigest(PAYLOAD)
    # Without an expected shape, the value's own shape is taken.
    assert isinstance(decode(value, FMT, HASH), Block)


def test_encode_refuses_a_payload_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="shape needs"):
        encode(FMT, HASH, SHAPE, [PAYLOAD[:-1]])
    with pytest.raises(ValueError, match="block_hash"):
        encode(FMT, HASH[:31], SHAPE, [PAYLOAD])


def test_flipped_payload_byte_is_a_checksum_failure() -> None:
    value = bytearray(_value())
    value[-100] ^= 0x01
    assert _reason(bytes(value)) == "checksum"


@pytest.mark.parametrize("keep", [0, 5, 30, 60, len(_value()) - len(PAYLOAD) - 1])
def test_cut_inside_the_header_is_truncated(keep: int) -> None:
    assert _reason(_value()[:keep]) == "truncated"


def test_cut_inside_the_payload_is_truncated() -> None:
    assert _reason(_value()[:-1]) == "truncated"


def test_extra_bytes_or_a_wrong_length_field_is_length() -> None:
    assert _reason(_value() + b"\0") == "length"
    value = bytearray(_value())
    (length,) = struct.unpack_from("<Q", value, PAYLOAD_LENGTH_OFFSET)
    struct.pack_into("<Q", value, PAYLOAD_LENGTH_OFFSET, length - 2)
    assert _reason(bytes(value)) == "length"


def test_magic_and_version() -> None:
    assert _reason(b"XXKVBLK1" + _value()[8:]) == "magic"
    assert _reason(b"not a block") == "magic"
    value = bytearray(_value())
    struct.pack_into("<H", value, VERSION_AT, 2)
    assert _reason(bytes(value)) == "version"


def test_wrong_hash_format_or_shape() -> None:
    assert _reason(_value(block_hash=hashlib.sha256(b"other").digest())) == "hash"
    assert _reason(_value(kv_format=OTHER_FMT)) == "format"
    other = BlockShape(num_kv_heads=2, num_layers=6, block_size=16, head_dim=8, dtype="bfloat16")
    assert other.payload_bytes == SHAPE.payload_bytes
    assert _reason(_value(shape=other), shape=SHAPE) == "shape"


def test_a_damaged_shape_field_is_caught() -> None:
    value = bytearray(_value())
    struct.pack_into("<I", value, 10, 0)  # num_kv_heads 0
    assert _reason(bytes(value)) == "shape"
    value = bytearray(_value())
    struct.pack_into("<I", value, 10, 5)  # num_kv_heads 5: the shape no longer matches the length
    assert _reason(bytes(value)) == "length"
    assert _reason(_value().replace(b"bfloat16", b"bfloat99", 1)) == "shape"
    assert _reason(_value().replace(b"head-major-v1", b"head-major-v2", 1)) == "shape"


def test_reasons_are_a_closed_set() -> None:
    assert set(REJECT_REASONS) == {"magic", "version", "truncated", "length", "checksum", "hash", "format", "shape"}


def test_shape_json_round_trip() -> None:
    assert BlockShape.from_json(SHAPE.to_json()) == SHAPE
    with pytest.raises(ValueError):
        BlockShape.from_json(b'{"num_kv_heads": 1}')
    with pytest.raises(ValueError):
        BlockShape.from_json(b"\xff")
    with pytest.raises(ValueError):
        BlockShape.from_json(SHAPE.to_json().replace(b"bfloat16", b"int8"))
