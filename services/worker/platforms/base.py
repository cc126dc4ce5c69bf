"""Device platform interface: device, distributed backend, memory, precision default and the op table."""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass

import torch

from services.common.engine_defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS
from services.worker.layers.decode_stack import DecodeStack, FusedDecode
from services.worker.layers.quantization import (
    BoundKernel,
    HalfWeight,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    binder_of,
    quantized_linear_reference,
)
from services.worker.startup_error import StartupError


@dataclass(frozen=True)
class MemoryInfo:
    """Free and total bytes of the device's memory."""

    free_bytes: int
    total_bytes: int


class DeviceUnavailableError(StartupError):
    """A platform cannot start on this machine; the message says what to do about it."""


class Ops(abc.ABC):
    """The kernels a model calls; each platform maps them to its fused ops."""

    # KV cache layout the attention ops read and write: "NHD" or "HND" (see layers/attention.py).
    kv_layout: str = "NHD"

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
        """Write k, v [T, Hk, D] into the paged caches (in kv_layout) at slot_mapping [T]."""

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
        """Causal attention of varlen queries [T, Hq, D] over the paged cache (prefill and decode).

        block_tables [B, max_blocks] int64 (padded with 0); seq_lens [B] and query_start_loc [B + 1]
        are int64 CPU tensors; a sequence's queries are its last tokens in the cache.
        """

    def int8_linear(self, x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
        """x [rows, in] times the int8 weight [out, in] dequantised, transposed: [rows, out] in x's dtype."""
        return quantized_linear_reference(x, weight)

    def int4_linear(self, x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
        """x [rows, in] times the 4-bit weight [out, in] dequantised, transposed: [rows, out] in x's dtype."""
        return quantized_linear_reference(x, weight)

    def half_linear(self, x: torch.Tensor, weight: HalfWeight) -> torch.Tensor:
        """x [rows, in] times the bf16/fp16 weight [out, in] widened to float32, transposed: [rows, out] in x's
        dtype."""
        return quantized_linear_reference(x, weight)

    def half_weight(self, weight: torch.Tensor) -> HalfWeight:
        """An unquantised model's weight [out, in] in the layout this table's half_linear reads best (as it is,
        unless a platform packs it)."""
        return HalfWeight(weight)

    def int8_weight(self, weight: Int8Weight, compute_dtype: torch.dtype) -> Int8Weight:
        """An int8 weight in the layout this table's int8_linear reads best for compute_dtype's activations (as it
        is, unless a platform packs it)."""
        return weight

    def quantized_kernel(self, weight: QuantizedWeight) -> BoundKernel:
        """The kernel for the weight's format with the weight bound (a KernelBinder: what a quantised layer's
        QuantizedMatmul runs); platforms with kernels bind theirs directly."""
        return binder_of(self.quantized_linear)(weight)

    def fused_decode(self, stack: DecodeStack) -> FusedDecode | None:
        """The stack's layers for a decode step in one call, computing what the per-layer path computes; None where
        the platform has no such form (every step then runs layer by layer)."""
        return None

    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """The kernel for the weight's format."""
        if isinstance(weight, Int4Weight):
            return self.int4_linear(x, weight)
        if isinstance(weight, HalfWeight):
            return self.half_linear(x, weight)
        return self.int8_linear(x, weight)


class Platform(abc.ABC):
    """One device type, bound to one local device index: where tensors live, how ranks talk, which kernels run."""

    name: str
    dist_backend: str
    # Block size the platform's paged-attention kernels require (None: any).
    required_block_size: int | None = None
    # --precision auto resolves to this on the platform.
    default_precision: str = "fp32-fp32-fp32"
    # A step's token budget when --max-num-batched-tokens is unset (the worker reports it to the scheduler).
    default_max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

    def __init__(self, local_rank: int = 0) -> None:
        self.local_rank = local_rank

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The torch device this rank's tensors are placed on."""

    @property
    @abc.abstractmethod
    def ops(self) -> Ops:
        """The platform's op table."""

    @abc.abstractmethod
    def set_device(self) -> None:
        """Bind this process to its device; must run before anything is allocated there."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Devices this process can see (after *_VISIBLE_DEVICES masking)."""

    @abc.abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Free and total memory of this rank's device in bytes."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for queued device work to finish (for timing and profiling)."""

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory measurement (no-op where the allocator keeps no statistics)."""
        return None

    def peak_memory_bytes(self) -> int:
        """Most bytes the allocator held since reset_peak_memory (0 where unknown)."""
        return 0

    def empty_cache(self) -> None:
        """Return cached, unused allocator blocks to the device."""
        return None

    def matmul_pack_dtype(self, compute_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype linear weights are reordered into once for oneDNN (layers.linear.pack_linears), or None."""
        return None

    def quantized_max_rows(self, compute_dtype: torch.dtype, tiled: bool = False) -> int:
        """Rows up to which --quantization runs a linear on its quantised weight, against the GEMM that
        compute_dtype's matmuls run on; 0: the platform has no quantised kernels worth running, so the flag
        is refused at startup rather than quietly slower. tiled: for an int8 weight the op table packed into
        tiles (Ops.int8_weight), whose kernel may win more rows."""
        return 0

    def half_max_rows(self, compute_dtype: torch.dtype, tiled: bool = False) -> int:
        """Rows up to which an unquantised model's linears run on their bf16/fp16 weight through
        Ops.half_linear rather than the GEMM compute_dtype's matmuls run on; 0: never. tiled: for a weight the
        op table packed into tiles (Ops.half_weight), whose kernel may win more rows."""
        return 0

    def matmul_backend(self, num_rows: int) -> contextlib.AbstractContextManager[None]:
        """Scope for matmuls whose input has num_rows rows, where the platform picks kernels by shape."""
        return contextlib.nullcontext()

    def is_out_of_memory(self, error: BaseException) -> bool:
        """Whether an exception raised by torch means the device ran out of memory."""
        return isinstance(error, torch.OutOfMemoryError)
