"""Block hashes: deterministic, chained, full blocks only."""

import os
import subprocess
import sys
from pathlib import Path

from services.scheduler.block_hash import hash_block_tokens, hash_request_blocks, root_hash


def test_same_tokens_same_hashes() -> None:
    tokens = list(range(40))
    assert hash_request_blocks(tokens, 16) == hash_request_blocks(list(tokens), 16)


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_request_blocks(list(range(47)), 16)) == 2
    assert len(hash_request_blocks(list(range(48)), 16)) == 3
    assert hash_request_blocks(list(range(15)), 16) == []


def test_hash_is_a_chain() -> None:
    a = hash_request_blocks([1] * 16 + [2] * 16, 16)
    b = hash_request_blocks([3] * 16 + [2] * 16, 16)
    # Same second block, different prefix: the second hashes differ.
    assert a[1] != b[1]
    assert a[1] == hash_block_tokens(a[0], [2] * 16)
    assert a[0] == hash_block_tokens(None, [1] * 16) == hash_block_tokens(root_hash(), [1] * 16)


def test_extra_keys_and_token_width_matter() -> None:
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2], b"lora")
    # Packed as int32: 256 is not confused with (0, 1).
    assert hash_block_tokens(None, [256]) != hash_block_tokens(None, [0, 1])
    assert len(hash_block_tokens(None, [1])) == 32


def test_stable_across_processes() -> None:
    code = (
        "from services.scheduler.block_hash import hash_request_blocks;"
        "print(','.join(h.hex() for h in hash_request_blocks(list(range(100)), 16)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        cwd=str(Path(__file__).resolve().parents[3]),
    ).stdout.strip()
    assert out.split(",") == [h.hex() for h in hash_request_blocks(list(range(100)), 16)]
