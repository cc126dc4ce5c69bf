"""Rotary position embedding (Hugging Face's rotate_half convention) and its cos/sin tables."""

from __future__ import annotations

from typing import Any

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the halves (x1, x2) of the last dim to (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by per-token cos/sin [T, D]."""
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_parameters(config: Any) -> dict[str, Any]:
    """Return the rope parameters of a HF config (transformers 5 `rope_parameters` or legacy fields)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    out.setdefault("rope_type", out.pop("type", "default"))
    return out


def inv_freq_for_config(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2], attention_scaling) for the config's rope type."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type") or "default"
    if rope_type == "default":
        theta = float(params["rope_theta"])
        # Explicit device: models are built under a meta-device context.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    if rope_type == "dynamic":
        raise NotImplementedError("rope_type 'dynamic' depends on sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init is None:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported")
    inv_freq, scaling = init(config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryTable:
    """Precomputed cos/sin [max_positions, head_dim] in float32, gathered per token position."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq.float().cpu())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * attention_scaling
        self.sin = emb.sin() * attention_scaling

    def to(self, device: torch.device) -> RotaryTable:
        """Move the tables to a device in place and return self."""
        self.cos = self.cos.to(device)
        self.sin = self.sin.to(device)
        return self

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (cos, sin) rows [T, head_dim] for the token positions [T]."""
        return self.cos[positions], self.sin[positions]
