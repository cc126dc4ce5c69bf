"""The kvstore contract's keys and caps, shared by the store, the scheduler and the worker (no torch here).

Every hop checks against these, so a lookup the scheduler builds or a slice a worker sends is never
refused by the store for its size.
"""

from __future__ import annotations

import re

# A KV format key names which blocks are interchangeable: model identity + KV dtype + block size.
KV_FORMAT_PREFIX = "meshserve-kv1:"
_KV_FORMAT = re.compile(r"meshserve-kv1:[0-9a-f]{64}")
# Block hashes are sha256 digests (services/scheduler/block_hash.py).
BLOCK_HASH_BYTES = 32
# Hashes in one Lookup or Get: 8192 blocks of 16 tokens are a 131,072-token sequence.
MAX_BLOCK_HASHES = 8192
# Payload bytes in one PutChunk or GetChunk: well under gRPC's 4 MiB default message size.
MAX_CHUNK_BYTES = 1024 * 1024
# One block's whole payload: far above any real model's block (SmolLM2-135M fp32, 16 tokens: 737 KB;
# a 70B model's bf16 block of 16 tokens is 5 MiB), low enough that a hostile header cannot make the
# store reserve gigabytes for one slice.
MAX_BLOCK_PAYLOAD_BYTES = 256 * 1024 * 1024
# Element types a block may hold, with their sizes in bytes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def is_valid_kv_format(key: str) -> bool:
    """Whether key has the form "meshserve-kv1:" + 64 lowercase hex digits."""
    return _KV_FORMAT.fullmatch(key) is not None
