"""KV cache sizing and allocation."""

from __future__ import annotations

import torch

from services.worker.kv_cache import KVCache, bytes_per_block

SHAPE = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 8}


def test_bytes_per_block() -> None:
    assert bytes_per_block(**SHAPE, dtype=torch.float32) == 2 * 2 * 16 * 2 * 8 * 4
    assert bytes_per_block(**SHAPE, dtype=torch.bfloat16) == 2 * 2 * 16 * 2 * 8 * 2


def test_allocate_shapes() -> None:
    cache = KVCache.allocate(num_blocks=3, **SHAPE, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert len(cache.layers) == 2
    k, v = cache.layers[0]
    assert k.shape == (3, 16, 2, 8) and v.shape == k.shape and k.dtype == torch.bfloat16
    assert k.data_ptr() != v.data_ptr()
