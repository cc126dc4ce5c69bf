"""KV cache sizing and allocation."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget

SHAPE = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 8}


def test_bytes_per_block() -> None:
    assert bytes_per_block(**SHAPE, dtype=torch.float32) == 2 * 2 * 16 * 2 * 8 * 4
    assert bytes_per_block(**SHAPE, dtype=torch.bfloat16) == 2 * 2 * 16 * 2 * 8 * 2


def test_num_blocks_from_budget() -> None:
    per_block = bytes_per_block(**SHAPE, dtype=torch.float32)
    assert num_blocks_for_budget(per_block * 10 + 5, **SHAPE, dtype=torch.float32, max_model_len=160) == 10


def test_too_small_budget_names_the_fix() -> None:
    per_block = bytes_per_block(**SHAPE, dtype=torch.float32)
    with pytest.raises(ValueError) as info:
        num_blocks_for_budget(per_block * 3, **SHAPE, dtype=torch.float32, max_model_len=100)
    message = str(info.value)
    assert "KV cache of 3 blocks cannot hold one --max-model-len=100 sequence" in message
    assert "raise --kv-cache-memory or lower --max-model-len" in message


def test_allocate_shapes() -> None:
    cache = KVCache.allocate(num_blocks=3, **SHAPE, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert len(cache.layers) == 2
    k, v = cache.layers[0]
    assert k.shape == (3, 16, 2, 8) and v.shape == k.shape and k.dtype == torch.bfloat16
    assert k.data_ptr() != v.data_ptr()
