"""RMSNorm reference ops (statistics in float32, as Hugging Face Llama does)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Return weight * x / sqrt(mean(x^2) + eps), computed in float32 and cast back to x's dtype."""
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    # Cast before the weight multiply to match Hugging Face's rounding in bf16.
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual): the fused pre-norm residual step."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
