"""Paged KV cache tensors: per layer K and V blocks in the op table's layout (NHD or HND)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.layers.attention import NHD, cache_shape


def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


@dataclass
class KVCache:
    """The cache tensors of every layer; slot = block_id * block_size + offset."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(
        cls,
        *,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: str = NHD,
    ) -> KVCache:
        """Allocate zeroed K and V tensors for every layer."""
        shape = cache_shape(num_blocks, block_size, num_kv_heads, head_dim, layout)
        layers = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
        return cls(layers=layers, num_blocks=num_blocks, block_size=block_size)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's K and V."""
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
