"""Ascend NPU platform: HCCL between ranks and torch_npu's fused kernels behind the op table.

torch_npu is imported in exactly one place, probe_npu, and only when the NPU platform is asked for;
the op table takes the imported module as an argument so tests can hand it a fake.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from services.worker.platforms.accelerator import TorchAcceleratorPlatform
from services.worker.platforms.base import DeviceUnavailableError, Ops
from services.worker.platforms.reference_ops import ReferenceOps

ALLOC_CONF_ENV = "PYTORCH_NPU_ALLOC_CONF"
# Expandable segments cut fragmentation of the large, long-lived KV cache tensors (as vllm-ascend sets it).
DEFAULT_ALLOC_CONF = "expandable_segments:True"
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
CANN_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
ASCEND_DOCKERFILE = "deploy/docker/Dockerfile.ascend"

# What a broken Ascend install raises at import or on first device query: ImportError (no torch_npu, or a
# wheel built for another torch), OSError (CANN libraries such as libhccl.so not on the loader path),
# RuntimeError (ACL could not open a device).
_PROBE_ERRORS = (ImportError, OSError, RuntimeError)
_MODULE_MISSING = "No module named 'torch_npu'"
_DEVICE_MISSING_MARKERS = ("ACL_ERROR_DEVICE_NOT_FOUND", "107001", "507033", "libascend_hal", "no NPU device")
_CANN_MISSING_MARKERS = ("cannot open shared object file", "libhccl", "libascendcl", "libacl")
_OOM_MARKERS = ("NPU out of memory", "ACL_ERROR_RT_MEMORY_ALLOCATION")

# The fused attention kernels take fp16/bf16 only; other dtypes run the pure-torch reference ops on the NPU.
_FUSED_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
# npu_apply_rotary_pos_emb is only used by vllm-ascend for head sizes 64 and 128; others take the reference.
_FUSED_ROTARY_HEAD_SIZES = (64, 128)
# FIA page attention: block_size a multiple of 128 (128..512).
_FIA_BLOCK_ALIGN = 128
# sparse_mode=3 (rightDownCausal) wants this fixed-size upper-triangular mask, whatever the sequence lengths.
_CAUSAL_MASK_SIZE = 2048


@dataclass(frozen=True)
class NpuProbe:
    """Whether torch_npu imports and sees devices; error keeps the failure's text."""

    available: bool
    device_count: int
    error: str | None = None


def probe_npu() -> NpuProbe:
    """Import torch_npu (the only place it is imported) and count the visible devices."""
    # Must be set before torch_npu initialises its allocator; a user's own value wins.
    os.environ.setdefault(ALLOC_CONF_ENV, DEFAULT_ALLOC_CONF)
    try:
        import torch_npu
    except _PROBE_ERRORS as e:
        return NpuProbe(available=False, device_count=0, error=_describe(e))
    return _probe_module(torch_npu)


def npu_unavailable_message(error: str) -> str:
    """A startup error for --device npu that keeps the original text and names the fix."""
    if _MODULE_MISSING in error:
        hint = (
            "torch_npu is not installed in this environment: install the `npu` extra together with the torch_npu "
            f"wheel that matches this torch and your CANN version, or run the Ascend image ({ASCEND_DOCKERFILE})."
        )
    elif any(marker in error for marker in _DEVICE_MISSING_MARKERS):
        hint = (
            "No Ascend device could be opened: check the driver with `npu-smi info`, that a container was started "
            f"with the /dev/davinci* devices, and {VISIBLE_DEVICES_ENV}."
        )
    elif any(marker in error for marker in _CANN_MISSING_MARKERS):
        hint = "The CANN libraries could not be loaded: the CANN environment is not set in this shell."
    else:
        hint = "torch_npu could not start."
    return (
        f"--device npu is unavailable: {error}\n{hint}\n"
        f"Load the CANN environment (`source {CANN_SET_ENV}`) before starting the worker and check that "
        "`npu-smi info` lists the devices; or run with `--device cpu`."
    )


class NpuOps(Ops):
    """The op table on torch_npu's fused kernels, following vllm-ascend's calls (module passed in for tests)."""

    def __init__(self, torch_npu_module: ModuleType) -> None:
        self._npu: Any = torch_npu_module
        self._reference = ReferenceOps()
        self._causal_masks: dict[torch.device, torch.Tensor] = {}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # The kernel wants gamma in x's dtype; promoting both keeps the reference's result dtype.
        dtype = torch.promote_types(x.dtype, weight.dtype)
        normed, _rstd = self._npu.npu_rms_norm(x.to(dtype), weight.to(dtype), eps)
        return normed

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(torch.promote_types(x.dtype, residual.dtype), weight.dtype)
        # Returns (y, rstd, x1 + x2).
        normed, _rstd, summed = self._npu.npu_add_rms_norm(x.to(dtype), residual.to(dtype), weight.to(dtype), eps)
        return normed, summed

    def apply_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # npu_apply_rotary_pos_emb rotates q and k in one launch (npu_rotary_mul would take two) but only for
        # the head sizes vllm-ascend routes to it.
        num_tokens, num_heads, head_dim = q.shape
        if head_dim not in _FUSED_ROTARY_HEAD_SIZES or k.dtype != q.dtype:
            return self._reference.apply_rotary(q, k, cos, sin)
        # It rotates in place: work on contiguous copies so the caller's q and k stay as they were.
        q4 = q.clone(memory_format=torch.contiguous_format).view(1, num_tokens, num_heads, head_dim)
        k4 = k.clone(memory_format=torch.contiguous_format).view(1, num_tokens, k.shape[1], head_dim)
        # BSND layout with B=1, S=T; cos/sin broadcast over heads as [1, T, 1, D] in q's dtype.
        cos4 = cos.to(q.dtype).reshape(1, num_tokens, 1, head_dim)
        sin4 = sin.to(q.dtype).reshape(1, num_tokens, 1, head_dim)
        q_out, k_out = self._npu.npu_apply_rotary_pos_emb(q4, k4, cos4, sin4)
        return q_out.view(q.shape), k_out.view(k.shape)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # The kernel rejects non-contiguous input.
        return self._npu.npu_swiglu(gate_up.contiguous(), dim=-1)

    def reshape_and_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if k_cache.dtype not in _FUSED_ATTENTION_DTYPES:
            self._reference.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
            return
        self._npu._npu_reshape_and_cache(
            key=k.to(k_cache.dtype).contiguous(),
            value=v.to(v_cache.dtype).contiguous(),
            key_cache=k_cache,
            value_cache=v_cache,
            slot_indices=slot_mapping.to(torch.int32),
        )

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
        if q.dtype not in _FUSED_ATTENTION_DTYPES or k_cache.dtype != q.dtype:
            return self._reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        if block_size % _FIA_BLOCK_ALIGN:
            raise ValueError(
                f"NPU paged attention needs a KV block size that is a multiple of {_FIA_BLOCK_ALIGN}, got "
                f"{block_size}; allocate the cache with NpuPlatform.required_block_size"
            )
        query = q.contiguous()
        num_heads = query.shape[1]
        block_table = block_tables.to(device=query.device, dtype=torch.int32)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        if bool((query_lens == 1).all()):
            # A pure decode step: the ATB paged-attention kernel, as vllm-ascend uses for DecodeOnly batches.
            out = torch.empty_like(query)
            self._npu._npu_paged_attention(
                query=query,
                key_cache=k_cache,
                value_cache=v_cache,
                num_kv_heads=num_kv_heads,
                num_heads=num_heads,
                scale_value=scale,
                block_table=block_table,
                # Read on the host to plan the kernel.
                context_lens=seq_lens.to(device="cpu", dtype=torch.int32),
                out=out,
            )
            return out
        # Prefill chunks, possibly mixed with decodes: fused infer attention over the paged cache viewed as
        # [num_blocks, block_size, Hk * D], varlen queries in TND; sparse_mode 3 aligns each query chunk to
        # the end of its sequence, which is this table's contract.
        out, _lse = self._npu.npu_fused_infer_attention_score(
            query,
            k_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            atten_mask=self._causal_mask(query.device),
            block_table=block_table,
            input_layout="TND",
            block_size=block_size,
            # Cumulative query ends for TND; per-sequence KV lengths for page attention.
            actual_seq_lengths=query_start_loc[1:].tolist(),
            actual_seq_lengths_kv=seq_lens.tolist(),
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            scale=scale,
            sparse_mode=3,
        )
        return out

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        """The 2048x2048 int8 upper-triangular mask (1 = masked) that sparse_mode 3 expects, one per device."""
        mask = self._causal_masks.get(device)
        if mask is None:
            ones = torch.ones(_CAUSAL_MASK_SIZE, _CAUSAL_MASK_SIZE, dtype=torch.int8)
            mask = torch.triu(ones, diagonal=1).to(device)
            self._causal_masks[device] = mask
        return mask


class NpuPlatform(TorchAcceleratorPlatform):
    """One Ascend NPU per rank (npu:local_rank among ASCEND_RT_VISIBLE_DEVICES), HCCL between ranks."""

    name = "npu"
    dist_backend = "hccl"
    # npu_fused_infer_attention_score's page attention needs block_size a multiple of 128 (128..512), and
    # 128 is the block size ATB's _npu_paged_attention is tuned for; one cache serves both kernels.
    required_block_size = 128
    default_precision = "bf16-fp16-fp32"

    def __init__(self, local_rank: int = 0, torch_npu_module: ModuleType | None = None) -> None:
        super().__init__(local_rank)
        if torch_npu_module is None:
            probe = probe_npu()
            # probe_npu imported it; take the loaded module rather than importing a second time.
            module = sys.modules.get("torch_npu") if probe.available else None
        else:
            probe = _probe_module(torch_npu_module)
            module = torch_npu_module
        if module is None or not probe.available:
            raise DeviceUnavailableError(npu_unavailable_message(probe.error or "torch_npu did not load"))
        if not 0 <= local_rank < probe.device_count:
            visible = os.environ.get(VISIBLE_DEVICES_ENV)
            raise DeviceUnavailableError(
                f"rank {local_rank} needs npu:{local_rank} but only {probe.device_count} NPU device(s) are "
                f"visible ({VISIBLE_DEVICES_ENV}={visible if visible is not None else 'unset'}); check "
                f"`npu-smi info`, widen {VISIBLE_DEVICES_ENV} or lower --tensor-parallel-size (or "
                "--pipeline-parallel-size)"
            )
        self._runtime: Any = _npu_runtime()
        self._ops = NpuOps(module)

    @property
    def ops(self) -> Ops:
        return self._ops

    def is_out_of_memory(self, error: BaseException) -> bool:
        # Newer torch_npu raises torch.OutOfMemoryError; older builds a plain RuntimeError with this text.
        if isinstance(error, torch.OutOfMemoryError):
            return True
        return isinstance(error, RuntimeError) and any(marker in str(error) for marker in _OOM_MARKERS)


def _describe(error: BaseException) -> str:
    """The exception's type and text, as kept in NpuProbe.error."""
    return f"{type(error).__name__}: {error}"


def _npu_runtime() -> Any:
    """torch.npu, the device namespace torch_npu registers on import (None before that)."""
    return getattr(torch, "npu", None)


def _probe_module(module: ModuleType) -> NpuProbe:
    """Ask an imported torch_npu (through the torch.npu it registered) whether it sees devices."""
    runtime = _npu_runtime()
    if runtime is None:
        return NpuProbe(available=False, device_count=0, error=f"{module.__name__} did not register torch.npu")
    try:
        available = bool(runtime.is_available())
        count = int(runtime.device_count()) if available else 0
    except _PROBE_ERRORS as e:
        return NpuProbe(available=False, device_count=0, error=_describe(e))
    if count <= 0:
        visible = os.environ.get(VISIBLE_DEVICES_ENV)
        masked = f" ({VISIBLE_DEVICES_ENV}={visible!r} is set)" if visible is not None else ""
        return NpuProbe(available=False, device_count=0, error=f"torch_npu found no NPU device{masked}")
    return NpuProbe(available=True, device_count=count)
