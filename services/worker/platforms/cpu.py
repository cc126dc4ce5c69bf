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
# The GEMM a step's bf16/fp16/fp32 matmuls run on where no small-step kernel takes them
# (CpuPlatform.matmul_gemm): MKL for fp32 compute; for half-precision compute, oneDNN on fp32 copies of the
# weights where the CPU has no native half GEMM (AVX2, AVX-512 without BF16), oneDNN in the half dtype itself
# (avx512_bf16, avx512_fp16), the same on AMX tiles for bf16, or ATen's own half matmul without oneDNN.
MKL_FP32 = "mkl-fp32"
ONEDNN_FP32_COPIES = "onednn-fp32-copies"
ONEDNN_HALF = "onednn-half"
ONEDNN_HALF_AMX = "onednn-half-amx"
ATEN_HALF = "aten-half"
# The suffix of SMALL_STEP_MAX_ROWS' weights key for half weights packed into tiles (half_linear_takes_tiles).
TILES = " tiles"
# Rows up to which a native small-step kernel beats that GEMM, keyed by the weights the kernel reads
# ("quantized": int8 and GGUF's 4-bit blocks; "bfloat16"/"float16": an unquantised model's own weights,
# through half_linear) and the GEMM; a pair not listed never takes the kernel. Measured over whole decode
# steps and a step's matmuls (benchmarks.step_matmuls; docs/benchmarks.md):
# - quantised against fp32 GEMMs: the kernels read a half or a quarter of the bytes and win up to 8 rows;
#   against oneDNN's native bf16 (AMX Xeon) a SmolLM2 step of 4 rows took 24 ms on int8 or Q4_1 weights
#   against 33 ms in bf16, and of 8 rows the bf16 GEMM won.
# - half weights against fp32 copies (twice the bytes) or ATen's one-row GEMV: on the Zen 3 EPYC a SmolLM2
#   step's matmuls took 16-31 ms on the kernel against 46-63 ms for 1-8 rows, 80 against 83-89 ms for 16,
#   and lost from 20 rows (109 against 85 ms).
# - bf16 weights against oneDNN's native bf16 GEMM (ATen's GEMV at one row, matmul_backend), through
#   half_linear's vdpbf16ps path: both read the weights below the memory's rate at few rows. Whole SmolLM2
#   decode steps on the AMX Xeon, two runs: 1 row 19.9 -> 18.3 and 19.7 -> 17.8 ms, 2 rows 20.9 -> 20.4 and
#   20.0 -> 20.5 (level), 4 rows 21.1 -> 22.6. On the Zen 4 EPYC (avx512_bf16, no AMX) a step's matmuls on
#   the widening path, which the vdpbf16ps path replaces, took 11.8 / 11.3 / 14.4 ms at 1 / 2 / 4 rows
#   against oneDNN's 17.0 / 20.3 / 16.8, and lost at 8 (25.5 against 16.8).
# - bf16 weights packed into AMX tiles (TILES; NativeCpuOps.half_weight) against oneDNN's AMX GEMM: a SmolLM2
#   step's matmuls (benchmarks.step_matmuls) at 1 / 8 / 32 / 64 / 128 rows took 9.5 / 9.7 / 12.0 / 18.4 / 27.3 ms
#   against 14.8 / 14.5 / 17.8 / 20.7 / 29.0, and lost at 256 (52.4 against 42.4).
# - bf16 weights packed into tiles on an AVX512-BF16 CPU without AMX (half_linear's vdpbf16ps tile path) against
#   oneDNN's avx512_bf16 GEMM, which reorders the weights every call: on the Zen 4 EPYC at 1 / 8 / 16 / 32 / 64 /
#   128 / 256 / 512 rows 9.4 / 10.4 / 14.9 / 27.1 / 43.0 / 81.7 / 156.8 / 337.4 ms against 15.6 / 16.0 / 20.4 /
#   31.8 / 50.3 / 89.9 / 169.9 / 353.3 (not measured past 512, where prefill chunks keep oneDNN).
# - int8 weights packed into tiles (TILES; NativeCpuOps.int8_weight) against oneDNN's AMX GEMM on the weights
#   dequantised: on the AMX Xeon at 1 / 4 / 8 / 16 / 20 / 24 / 32 rows 6.6-7.4 / 8.0 / 10.1-11.0 / 16.4 / 19.6 / 24.1
#   / 30.8 ms against 18.9-20.1 / 19.6 / 19.8 / 20.2 / 21.7 / 21.8 / 24.1 (the plain int8 kernel: 8.7-10.0 / 14.8 /
#   26.1-27.1 / 52.2 / 69.5 / 94.7 / 133.2). On the Zen 4 EPYC (no AMX: vpdpwssd on AVX512-VNNI) against oneDNN's
#   avx512_bf16 GEMM, three runs at 1 / 2 / 4 / 8 / 16 / 32 rows: 6.5-7.9 / 6.7-6.8 / 6.6-8.9 / 11.0-12.0 / 22.7 /
#   40.2 ms against 14.1-17.9 / 16.6-17.3 / 12.1-16.3 / 14.1-15.5 / 19.6 / 28.1 (the plain int8 kernel 5.7-8.4 /
#   13.0-13.5 / 17.7-26.7 / 29.4-33.4). The tile kernel beats the plain one from 2 rows and is level at one, so
#   against a GEMM it was not timed on it takes the plain kernel's rows (CpuPlatform.quantized_max_rows).
SMALL_STEP_MAX_ROWS: dict[tuple[str, str], int] = {
    ("quantized", MKL_FP32): 8,
    ("quantized", ONEDNN_FP32_COPIES): 8,
    ("quantized", ATEN_HALF): 8,
    ("quantized", ONEDNN_HALF): 4,
    ("quantized", ONEDNN_HALF_AMX): 4,
    ("bfloat16", ONEDNN_FP32_COPIES): 16,
    ("float16", ONEDNN_FP32_COPIES): 16,
    ("bfloat16", ONEDNN_HALF_AMX): 1,
    ("bfloat16" + TILES, ONEDNN_HALF_AMX): 128,
    ("bfloat16", ONEDNN_HALF): 4,
    ("bfloat16" + TILES, ONEDNN_HALF): 512,
    ("int8" + TILES, ONEDNN_HALF_AMX): 16,
    ("int8" + TILES, ONEDNN_HALF): 8,
}
# On a CPU with AMX tiles torch's bf16 SDPA (flash attention on oneDNN's AMX kernels) beats the native
# prefill kernel's vdpbf16ps path on a chunk of this many causal query-key pairs and more
# (scripts/prefill_attention_bench.py on the AMX Xeon: 1.9x on a 512-token prompt, 1.2x on 50 tokens after
# 992 cached, even at a 96-token prompt; the kernel 1.5-2.4x on 32-64-token ones, where SDPA's per-sequence
# call and gather dominate). Without AMX the kernel wins every shape (3.7-5.4x on the Zen 4 EPYC).
SDPA_PREFILL_PAIRS_AMX = 4096
# Where the kernel multiplies on the AMX tiles itself (a library built with them, the tile state granted),
# SDPA wins only from about a 1,024-token causal chunk (the same script: the kernel 1.3-1.7x SDPA at 128-512
# tokens, 1.0-1.1x at 768-1,024, 0.81x at 2,048; 1.7x on 64 tokens after 1,000 cached, 2.5-2.8x on 32
# prompts of 64).
SDPA_PREFILL_PAIRS_AMX_TILES = 1024 * 1025 // 2


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
    return NativeCpuOps(
        attention.HND,
        sdpa_prefill_pairs=_sdpa_prefill_pairs(),
        half_tiles=bool(torch.ops.meshserve_cpu.half_linear_takes_tiles()),
        int8_tiles=bool(torch.ops.meshserve_cpu.int8_linear_takes_tiles()),
    )


def _sdpa_prefill_pairs() -> int | None:
    """The causal pairs from which a bf16 prefill chunk goes to torch's SDPA (None: never), by whether the CPU
    and the loaded kernels have AMX tiles."""
    if not torch.cpu._is_amx_tile_supported():
        return None
    if torch.ops.meshserve_cpu.prefill_attention_on_amx():
        return SDPA_PREFILL_PAIRS_AMX_TILES
    return SDPA_PREFILL_PAIRS_AMX


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

    def quantized_max_rows(self, compute_dtype: torch.dtype, tiled: bool = False) -> int:
        # The native kernels read each quantised weight once per step and beat the fp32/bf16 GEMMs while a
        # step is bound by weight bytes; past the threshold oneDNN's packed GEMM wins (docs/benchmarks.md).
        # The reference ops would dequantise every call: no faster than bf16.
        plain = self._small_step_rows("quantized", compute_dtype)
        return max(plain, self._small_step_rows("int8" + TILES, compute_dtype)) if tiled else plain

    def half_max_rows(self, compute_dtype: torch.dtype, tiled: bool = False) -> int:
        if compute_dtype == torch.float32:
            return 0
        # Against a native half GEMM only half_linear's vdpbf16ps and tile paths pay, built where the CPU has
        # the instructions (kernels/loader.py's avx512_bf16 and avx512_amx builds); its widening path reads
        # no fewer bytes.
        native = self.matmul_gemm(compute_dtype) in (ONEDNN_HALF, ONEDNN_HALF_AMX)
        if native and loader.isa()[0] not in loader.BF16_DOT_BUILDS:
            return 0
        weights = str(compute_dtype).removeprefix("torch.") + (TILES if tiled else "")
        return self._small_step_rows(weights, compute_dtype)

    def _small_step_rows(self, weights: str, compute_dtype: torch.dtype) -> int:
        if not isinstance(self._ops, NativeCpuOps):
            return 0
        return SMALL_STEP_MAX_ROWS.get((weights, self.matmul_gemm(compute_dtype)), 0)

    def matmul_gemm(self, compute_dtype: torch.dtype) -> str:
        """The GEMM compute_dtype's matmuls run on where no small-step kernel takes them (MKL_FP32, ...)."""
        if compute_dtype == torch.float32:
            return MKL_FP32
        pack_dtype = self.matmul_pack_dtype(compute_dtype)
        if pack_dtype is None:
            return ATEN_HALF
        if pack_dtype == torch.float32:
            return ONEDNN_FP32_COPIES
        amx = compute_dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
        return ONEDNN_HALF_AMX if amx else ONEDNN_HALF

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
