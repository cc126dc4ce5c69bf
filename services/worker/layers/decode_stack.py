"""A stage's decoder layers described for a platform that runs a decode step's layers in one call (Ops.fused_decode).

The description holds what each layer's bound form (models/llama.py) holds: its norms' weights in the
accumulation dtype, each linear's small-step weight and its bias in the compute dtype, and the attention's
shape. A platform's fused form must compute exactly what those bound forms compute, kernel for kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.worker.layers.attention import AttentionMetadata
from services.worker.layers.quantization import QuantizedMatmul

# (hidden [T, hidden], residual or None, cos, sin, the layers' KV caches, metadata) -> (hidden, residual) after
# the last layer, or None when this step is not one the fused form takes (the per-layer loop runs it).
FusedDecode = Callable[
    [
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        torch.Tensor,
        Sequence[tuple[torch.Tensor, torch.Tensor]],
        AttentionMetadata,
    ],
    tuple[torch.Tensor, torch.Tensor] | None,
]


@dataclass(frozen=True)
class StackLinear:
    """One linear as a small step runs it: its kernel's weight and its bias (compute dtype), added after the kernel
    (and after the all-reduce, which a stack never has: it is described on one tensor-parallel rank only)."""

    matmul: QuantizedMatmul
    bias: torch.Tensor | None


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer: pre-norm attention, then pre-norm SwiGLU MLP, the residual carried between."""

    input_norm: torch.Tensor
    qkv: StackLinear
    o: StackLinear
    post_norm: torch.Tensor
    gate_up: StackLinear
    down: StackLinear

    @property
    def linears(self) -> tuple[StackLinear, StackLinear, StackLinear, StackLinear]:
        """In the order the layer runs them."""
        return self.qkv, self.o, self.gate_up, self.down


@dataclass(frozen=True)
class DecodeStack:
    """A stage's layers with the shapes and dtypes every one shares."""

    layers: tuple[StackLayer, ...]
    eps: float
    scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    accum: torch.dtype
    compute: torch.dtype

    @property
    def max_rows(self) -> int:
        """The most rows a step may have for every linear to run its small-step kernel."""
        return min(linear.matmul.max_rows for layer in self.layers for linear in layer.linears)
