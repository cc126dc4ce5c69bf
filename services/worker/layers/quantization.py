"""Weight-only int8 (`--quantization int8`): each linear's weight rounded to int8 with one float32 scale
per output row (torchao's int8 weight-only), activations left in the compute dtype (W8A16).

Scales per group of input columns (llama.cpp's Q8_0 idea) are supported by quantize_int8 and the
kernel, but not the default: on SmolLM2, groups of 64 took the logit error from 4.9% to 4.1% and
groups of 16 to 2.8% (bf16 alone: 1.4%) while the one-row step got 1.4x slower (docs/benchmarks.md).

Decode is bound by the bytes of weights a step reads (docs/benchmarks.md): int8 reads a quarter of
fp32's and half of bf16's. Steps with more rows than the platform's `int8_max_rows` are bound by
arithmetic instead; they keep the platform's fastest GEMM, run on the int8 weight dequantised (packed
once for oneDNN where the CPU packs, dequantised once at load where it does not), so every step size computes the
same model and quantising never slows a prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Symmetric: the largest magnitude of a group maps to 127 (-128 is never used, so negation is exact).
INT8_LEVELS = 127


@dataclass(frozen=True)
class Int8Weight:
    """A weight [out, in] as int8 and float32 scales [out, groups]: weight ~ qweight * scales per group
    of in / groups consecutive columns."""

    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the int8 values stand for, in dtype (float32 products, one rounding)."""
        out_features, in_features = self.qweight.shape
        groups = self.scales.shape[1]
        grouped = self.qweight.float().view(out_features, groups, in_features // groups) * self.scales[:, :, None]
        return grouped.view(out_features, in_features).to(dtype)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Round weight to int8 with scale max|group| / 127 per group of group_size columns (None, or a size
    that does not divide the width: one group per row; an all-zero group gets scale 1)."""
    rows = weight.detach().float()
    out_features, in_features = rows.shape
    size = group_size if group_size is not None and in_features % group_size == 0 else in_features
    grouped = rows.view(out_features, in_features // size, size)
    absmax = grouped.abs().amax(dim=2)
    scales = torch.where(absmax > 0, absmax / INT8_LEVELS, torch.ones_like(absmax))
    qweight = torch.round(grouped / scales[:, :, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return Int8Weight(qweight.view(out_features, in_features).contiguous(), scales.contiguous())


# The weight formats a quantised linear may hold; each has nbytes and dequantize(dtype).
QuantizedWeight = Int8Weight
# A platform's kernel for a quantised weight: x [rows, in] -> [rows, out] in x's dtype.
QuantizedLinearOp = Callable[[torch.Tensor, QuantizedWeight], torch.Tensor]


def int8_linear_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x W^T with W dequantised: float32 products and sums, rounded once to x's dtype (the oracle)."""
    return F.linear(x.float(), weight.dequantize(torch.float32)).to(x.dtype)


@dataclass(frozen=True)
class QuantizedMatmul:
    """What a quantised linear needs at run time: its quantised weight, the platform's kernel for it, the row
    count up to which that kernel beats the platform's GEMM, and, where no packed copy takes the larger
    steps, the weight dequantised once (at load, never per step)."""

    weight: QuantizedWeight
    op: QuantizedLinearOp
    max_rows: int
    dense: torch.Tensor | None = None

    def applies(self, num_rows: int) -> bool:
        return num_rows <= self.max_rows
