"""Paged KV cache tensors: per layer K and V blocks in the op table's layout (NHD or HND).

On the CPU every layer's K and V are views of one tensor [num_layers, 2, *layer shape], so moving a block
to or from the kvstore is one indexed copy across all layers (kv_blocks.stacked_view) instead of one per
layer and K/V: 60 small ops for SmolLM2's 30 layers, ~0.5 ms of the model thread per step that saves. On a
device each layer keeps an allocation of its own, as its attention kernels expect (a view with a storage
offset is not something every NPU op takes).
"""

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
        """Allocate zeroed K and V tensors for every layer (views of one tensor on the CPU)."""
        shape = cache_shape(num_blocks, block_size, num_kv_heads, head_dim, layout)
        if device.type == "cpu":
            stacked = torch.zeros((num_layers, 2, *shape), dtype=dtype, device=device)
            return cls(
                layers=[(stacked[layer, 0], stacked[layer, 1]) for layer in range(num_layers)],
                num_blocks=num_blocks,
                block_size=block_size,
            )
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
