"""Device platform interface: device, distributed backend, memory info and the op table."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryInfo:
    """Free and total bytes of the device's memory."""

    free_bytes: int
    total_bytes: int


class Ops(abc.ABC):
    """The kernels a model calls; each platform maps them to its fused ops."""

    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x over its last dim."""

    @abc.abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (rms_norm(x + residual), x + residual)."""

    @abc.abstractmethod
    def apply_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by cos/sin [T, D] (rotate_half convention)."""

    @abc.abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: silu(first half) * second half of the last dim."""

    @abc.abstractmethod
    def reshape_and_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write k, v [T, Hk, D] into the paged caches at slot_mapping [T]."""

    @abc.abstractmethod
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
        """Causal attention of varlen queries [T, Hq, D] over the paged cache (prefill and decode)."""


class Platform(abc.ABC):
    """One device type: where tensors live, how ranks talk, and which kernels run."""

    name: str
    dist_backend: str

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The torch device tensors are placed on."""

    @property
    @abc.abstractmethod
    def ops(self) -> Ops:
        """The platform's op table."""

    @abc.abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Free and total device memory in bytes."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for queued device work to finish (for timing)."""
