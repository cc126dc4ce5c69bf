"""CPU platform: pure-torch reference ops from services.worker.layers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from services.worker.layers import activation, attention, norm, rotary
from services.worker.platforms.base import MemoryInfo, Ops, Platform


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
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, self.kv_layout
        )


@contextlib.contextmanager
def _without_onednn() -> Iterator[None]:
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


class CpuPlatform(Platform):
    """Host CPU with gloo for tensor parallelism."""

    name = "cpu"
    dist_backend = "gloo"

    def __init__(self, local_rank: int = 0) -> None:
        super().__init__(local_rank)
        # Head-major blocks gather into the attention matmuls' layout in one copy.
        self._ops = ReferenceOps(attention.HND)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def ops(self) -> Ops:
        return self._ops

    def matmul_backend(self, num_rows: int) -> contextlib.AbstractContextManager[None]:
        # A one-row bf16 matmul (a batch-1 decode) runs 1.3-2x faster in ATen's own GEMV than in
        # oneDNN, which wins from two rows up (docs/benchmarks.md). fp32 and fp16 never use oneDNN here.
        if num_rows == 1:
            return _without_onednn()
        return contextlib.nullcontext()

    def set_device(self) -> None:
        # Ranks share host memory; CPU placement is the CPU-binding step's job.
        return None

    def device_count(self) -> int:
        return 1

    def memory_info(self) -> MemoryInfo:
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(
            free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page,
            total_bytes=os.sysconf("SC_PHYS_PAGES") * page,
        )

    def is_out_of_memory(self, error: BaseException) -> bool:
        # The CPU allocator raises a plain RuntimeError when malloc fails.
        return isinstance(error, torch.OutOfMemoryError) or (
            isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
        )

    def synchronize(self) -> None:
        # CPU ops are synchronous.
        return None
