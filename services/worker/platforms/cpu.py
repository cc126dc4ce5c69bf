"""CPU platform: native kernels where they build, else the pure-torch reference ops."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import structlog
import torch

from services.worker.engine_config import CPU_KERNELS
from services.worker.kernels import loader
from services.worker.layers import attention
from services.worker.platforms.base import DeviceUnavailableError, MemoryInfo, Ops, Platform
from services.worker.platforms.cpu_native_ops import NativeCpuOps
from services.worker.platforms.reference_ops import ReferenceOps

log = structlog.get_logger()
# Rows up to which the native quantised kernels (int8, and GGUF's 4-bit blocks) beat the GEMM they replace,
# measured over whole decode steps (docs/benchmarks.md): oneDNN on fp32 copies of the weights (hosts without
# native bf16/fp16 GEMMs, and fp32 compute), or oneDNN in the half-precision dtype itself where the CPU runs
# that natively (AMX, avx512_bf16). On the AMX Xeon a SmolLM2 step of 4 rows took 24 ms on int8 or Q4_1
# weights against 33 ms in bf16, and of 8 rows the bf16 GEMM won.
QUANTIZED_MAX_ROWS = 8
QUANTIZED_MAX_ROWS_NATIVE_HALF = 4
# Rows up to which an unquantised bf16/fp16 model's linears read their half-precision weight through the
# native half_linear kernel where the CPU has no native half GEMM (AVX2, AVX-512 without BF16, the portable
# build), instead of oneDNN on fp32 copies (twice the bytes) or ATen's one-row GEMV. On the Zen 3 EPYC a
# SmolLM2 step's matmuls (benchmarks.step_matmuls) took 16-31 ms on it against 46-63 ms for 1-8 rows,
# 80 against 83-89 ms for 16, and lost from 20 rows (109 against 85 ms); docs/benchmarks.md.
HALF_MAX_ROWS = 16
# On a CPU with AMX tiles torch's bf16 SDPA (flash attention on oneDNN's AMX kernels) beats the native
# prefill kernel on a chunk of this many causal query-key pairs and more (scripts/prefill_attention_bench.py
# on the AMX Xeon: 1.9x on a 512-token prompt, 1.2x on 50 tokens after 992 cached, even at a 96-token
# prompt; the kernel 1.5-2.4x on 32-64-token ones, where SDPA's per-sequence call and gather dominate).
# Without AMX the kernel wins every shape (3.7-5.4x on the Zen 4 EPYC).
SDPA_PREFILL_PAIRS_AMX = 4096


def cpu_ops(kernels: str = "auto") -> Ops:
    """The CPU op table for --cpu-kernels; `auto` falls back to the reference ops, with a warning, if the
    native kernels cannot be built here (no C++ compiler, say)."""
    if kernels not in CPU_KERNELS:
        raise ValueError(f"--cpu-kernels must be one of {list(CPU_KERNELS)}, got {kernels!r}")
    # Head-major blocks: the native kernel reads them in place, the reference gathers them in one copy.
    if kernels == "reference":
        return ReferenceOps(attention.HND)
    try:
        loader.load()
    except loader.KernelBuildError as error:
        if kernels == "native":
            raise DeviceUnavailableError(
                f"--cpu-kernels native: {error}. Install a C++ compiler (g++) and ninja, "
                "or run with --cpu-kernels reference"
            ) from error
        log.warning("cpu_kernels_unavailable", error=str(error), fallback="reference")
        return ReferenceOps(attention.HND)
    amx = torch.cpu._is_amx_tile_supported()
    return NativeCpuOps(attention.HND, sdpa_prefill_pairs=SDPA_PREFILL_PAIRS_AMX if amx else None)


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

    def __init__(self, local_rank: int = 0, kernels: str = "auto") -> None:
        super().__init__(local_rank)
        self._ops = cpu_ops(kernels)
        self._kernels = kernels

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def ops(self) -> Ops:
        return self._ops

    def quantized_max_rows(self, compute_dtype: torch.dtype) -> int:
        # The native kernels read each quantised weight once per step and beat the fp32/bf16 GEMMs while a
        # step is bound by weight bytes; past the threshold oneDNN's packed GEMM wins (docs/benchmarks.md).
        # The reference ops would dequantise every call: no faster than bf16.
        if not isinstance(self._ops, NativeCpuOps):
            return 0
        native_half = compute_dtype != torch.float32 and self.matmul_pack_dtype(compute_dtype) == compute_dtype
        return QUANTIZED_MAX_ROWS_NATIVE_HALF if native_half else QUANTIZED_MAX_ROWS

    def half_max_rows(self, compute_dtype: torch.dtype) -> int:
        # Only where the packed GEMM widens the weights: a native bf16/fp16 GEMM reads the half weights itself.
        if not isinstance(self._ops, NativeCpuOps) or compute_dtype == torch.float32:
            return 0
        return HALF_MAX_ROWS if self.matmul_pack_dtype(compute_dtype) == torch.float32 else 0

    def matmul_pack_dtype(self, compute_dtype: torch.dtype) -> torch.dtype | None:
        # fp32 matmuls go to MKL. bf16/fp16 ones go to oneDNN: in their own dtype where it runs them natively
        # (avx512_bf16, AMX), else in fp32 on fp32 copies of the weights. ATen's fallback half-precision GEMM
        # is 4-6x slower than either on AVX2 hosts, and widening bf16 is exact, so the fp32 GEMM rounded
        # once at the end is the same computation as a bf16 GEMM with fp32 accumulation.
        if self._kernels == "reference" or compute_dtype == torch.float32:
            return None
        if not torch.backends.mkldnn.is_available():
            return None
        native = {
            torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
            torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
        }.get(compute_dtype)
        if native is None:
            return None
        return compute_dtype if native() else torch.float32

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
