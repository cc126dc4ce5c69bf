"""The pure-torch op table (services.worker.layers): the CPU fallback and the oracle device ops are tested against."""

from __future__ import annotations

import torch

from services.worker.layers import activation, attention, norm, rotary
from services.worker.platforms.base import Ops


class ReferenceOps(Ops):
    """The pure-torch ops; also the oracle that device platforms are tested against."""

    def __init__(self, layout: str = attention.NHD) -> None:
        if layout not in attention.LAYOUTS:
            raise ValueError(f"unknown KV cache layout {layout!r}; expected one of {attention.LAYOUTS}")
        self.kv_layout = layout

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rms_norm(x, residual, weight, eps)

    def apply_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.apply_rotary(q, k, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(gate_up)

    def reshape_and_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        attention.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, self.kv_layout)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return attention.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            self.kv_layout,
            decode=self.decode_attention,
            prefill=self.prefill_attention,
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        layout: str,
    ) -> torch.Tensor:
        """One query token per sequence (paged_attention's decode rows); subclasses swap in a kernel."""
        return attention.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, layout)

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        layout: str,
    ) -> torch.Tensor:
        """The multi-token sequences' rows (paged_attention's prefill chunks); subclasses swap in a kernel."""
        return attention.prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout)
