"""KV cache sizing and allocation."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_cache import KVCache, bytes_per_block
from services.worker.layers.attention import HND, NHD

SHAPE = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 8}


def test_bytes_per_block() -> None:
    assert bytes_per_block(**SHAPE, dtype=torch.float32) == 2 * 2 * 16 * 2 * 8 * 4
    assert bytes_per_block(**SHAPE, dtype=torch.bfloat16) == 2 * 2 * 16 * 2 * 8 * 2


@pytest.mark.parametrize(("layout", "shape"), [(NHD, (3, 16, 2, 8)), (HND, (3, 2, 16, 8))])
def test_allocate_shapes(layout: str, shape: tuple[int, ...]) -> None:
    cache = KVCache.allocate(
        num_blocks=3, num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
        device=torch.device("cpu"), layout=layout,
    )  # fmt: skip
    assert len(cache.layers) == 2
    k, v = cache.layers[0]
    assert k.shape == shape and v.shape == k.shape and k.dtype == torch.bfloat16
    assert k.data_ptr() != v.data_ptr()
