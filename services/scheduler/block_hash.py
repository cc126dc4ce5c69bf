"""Content hashes of full KV blocks, chained so a hash names a whole prefix."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT_SEED = b"meshserve-v1-root"


def root_hash() -> bytes:
    """Parent of the first block: a fixed seed, the same in every process."""
    return hashlib.sha256(_ROOT_SEED).digest()


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """sha256(parent ‖ token ids as little-endian int32 ‖ extra keys)."""
    h = hashlib.sha256(root_hash() if parent is None else parent)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    h.update(extra_keys)
    return h.digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, extra_keys: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of token_ids (a partial tail block is skipped)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
