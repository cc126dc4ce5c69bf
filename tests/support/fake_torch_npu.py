"""A fake torch_npu for CPU tests: the fused ops on the reference ops, with the real signatures and checks.

Each op keeps torch_npu's argument names, order, keyword-only markers, return tuples and in-place writes, and
raises like the kernel would (FakeNpuOpError, a RuntimeError) on a wrong dtype, layout or shape, so a call
that would fail or compute garbage on an Ascend device fails here too. Sources of the signatures:
Ascend/op-plugin (docs/context/*.md, op_plugin/ops/atb/*.cpp) and vllm-project/vllm-ascend's call sites.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import types
from collections import Counter
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.worker.layers import activation, attention, norm

GiB = 1 << 30
HALF_DTYPES = (torch.float16, torch.bfloat16)
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
INT_MAX = 2147483647


class FakeNpuOpError(RuntimeError):
    """What a torch_npu kernel raises when its input checks fail."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise FakeNpuOpError(message)


def _int_list(name: str, values: object) -> list[int]:
    """SymInt[] arguments: a list or tuple of Python ints."""
    if not isinstance(values, list | tuple) or not all(isinstance(v, int) for v in values):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__}")
    return list(values)


# ---- norms and activation -------------------------------------------------------------------------


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (y, rstd); computed in fp32, rounded once."""
    _require(self.dtype in NORM_DTYPES, f"npu_rms_norm: dtype {self.dtype} not supported")
    _require(gamma.dtype == self.dtype, f"npu_rms_norm: gamma dtype {gamma.dtype} != self dtype {self.dtype}")
    _require(2 <= self.dim() <= 8, f"npu_rms_norm: self must have 2-8 dims, got {self.dim()}")
    _require(
        gamma.shape == self.shape[-gamma.dim() :], f"npu_rms_norm: gamma {tuple(gamma.shape)} vs {tuple(self.shape)}"
    )
    x32 = self.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return norm.rms_norm(x32, gamma.float(), epsilon).to(self.dtype), rstd


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (y, rstd, x1 + x2)."""
    _require(x1.dtype in NORM_DTYPES, f"npu_add_rms_norm: dtype {x1.dtype} not supported")
    _require(x1.dtype == x2.dtype == gamma.dtype, "npu_add_rms_norm: x1, x2 and gamma must share a dtype")
    _require(x1.shape == x2.shape, f"npu_add_rms_norm: x1 {tuple(x1.shape)} != x2 {tuple(x2.shape)}")
    _require(gamma.shape == x1.shape[-gamma.dim() :], "npu_add_rms_norm: gamma must match x1's trailing dims")
    summed = x1.float() + x2.float()
    rstd = torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    normed = norm.rms_norm(summed, gamma.float(), epsilon).to(x1.dtype)
    return normed, rstd, summed.to(x1.dtype)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """npu_swiglu(Tensor input, int dim=-1) -> Tensor: silu(first half) * second half along dim."""
    _require(input.dtype in NORM_DTYPES, f"npu_swiglu: dtype {input.dtype} not supported")
    _require(input.is_contiguous(), "npu_swiglu: non-contiguous input is not supported")
    _require(input.shape[dim] % 2 == 0, f"npu_swiglu: dim {dim} of {tuple(input.shape)} is not even")
    moved = input.float().movedim(dim, -1)
    return activation.silu_and_mul(moved).movedim(-1, dim).to(input.dtype)


# ---- rotary -------------------------------------------------------------------------------------


def npu_apply_rotary_pos_emb(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str = "BSH",
    rotary_mode: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query (B, S, Nq, D) and key (B, S, Nk, D) in place by cos/sin (B, S, 1, D); returns (query, key)."""
    _require(layout == "BSH", f"npu_apply_rotary_pos_emb: layout {layout!r} is not modelled (only 'BSH' = BSND)")
    if rotary_mode != "half":
        raise NotImplementedError(f"fake npu_apply_rotary_pos_emb models rotary_mode 'half' only, got {rotary_mode!r}")
    tensors = (query, key, cos, sin)
    _require(all(t.dim() == 4 for t in tensors), "npu_apply_rotary_pos_emb: query, key, cos, sin must be 4-D")
    _require(len({t.dtype for t in tensors}) == 1, "npu_apply_rotary_pos_emb: all inputs must share a dtype")
    _require(query.dtype in NORM_DTYPES, f"npu_apply_rotary_pos_emb: dtype {query.dtype} not supported")
    batch, seq, _, head_dim = query.shape
    _require(key.shape[:2] == (batch, seq), "npu_apply_rotary_pos_emb: key's B, S differ from query's")
    _require(key.shape[3] == head_dim, "npu_apply_rotary_pos_emb: key's D differs from query's")
    for name, table in (("cos", cos), ("sin", sin)):
        _require(
            table.shape == (batch, seq, 1, head_dim),
            f"npu_apply_rotary_pos_emb: {name} {tuple(table.shape)} must be (B, S, 1, D) = {(batch, seq, 1, head_dim)}",
        )
    # vllm-ascend only routes head sizes 64 and 128 here; other sizes are not modelled.
    _require(head_dim in (64, 128), f"npu_apply_rotary_pos_emb: head size {head_dim} not supported")
    for x in (query, key):
        x32 = x.float()
        half = head_dim // 2
        rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
        x.copy_(x32 * cos.float() + rotated * sin.float())
    return query, key


# ---- paged KV cache -----------------------------------------------------------------------------


def _check_paged_cache(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _require(key_cache.dim() == 4, f"{op}: key_cache must be [num_blocks, block_size, num_kv_heads, head_size]")
    _require(key_cache.shape == value_cache.shape, f"{op}: key_cache and value_cache shapes differ")
    _require(key_cache.dtype == value_cache.dtype, f"{op}: key_cache and value_cache dtypes differ")
    _require(key_cache.dtype in (*HALF_DTYPES, torch.int8), f"{op}: cache dtype {key_cache.dtype} not supported")


def _npu_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """ATB _npu_reshape_and_cache(key, value, Tensor(a!) key_cache, Tensor(b!) value_cache, slot_indices)."""
    op = "_npu_reshape_and_cache"
    _check_paged_cache(op, key_cache, value_cache)
    _require(slot_indices.dtype == torch.int32, f"{op}: slot_indices must be int32, got {slot_indices.dtype}")
    _require(slot_indices.dim() == 1, f"{op}: slot_indices must be 1-D")
    num_tokens = slot_indices.shape[0]
    expected = (num_tokens, key_cache.shape[2], key_cache.shape[3])
    _require(tuple(key.shape) == expected, f"{op}: key {tuple(key.shape)} must be {expected}")
    _require(tuple(value.shape) == expected, f"{op}: value {tuple(value.shape)} must be {expected}")
    _require(key.dtype == value.dtype == key_cache.dtype, f"{op}: key/value dtype must match the cache dtype")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    _require(bool(((slot_indices >= 0) & (slot_indices < num_slots)).all()), f"{op}: slot index out of range")
    attention.reshape_and_cache(key, value, key_cache, value_cache, slot_indices.long())


def _npu_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """ATB decode attention: one query token per sequence [B, Nq, D] over the paged cache, written into out."""
    op = "_npu_paged_attention"
    _check_paged_cache(op, key_cache, value_cache)
    _require(query.dtype in HALF_DTYPES, f"{op}: query dtype {query.dtype} not supported")
    _require(key_cache.dtype == query.dtype, f"{op}: cache dtype {key_cache.dtype} != query dtype {query.dtype}")
    _require(query.dim() == 3, f"{op}: query must be [num_tokens, num_heads, head_size]")
    batch, _, head_dim = query.shape
    _require(num_heads == query.shape[1], f"{op}: num_heads={num_heads} but query has {query.shape[1]} heads")
    _require(
        num_kv_heads == key_cache.shape[2], f"{op}: num_kv_heads={num_kv_heads} but cache has {key_cache.shape[2]}"
    )
    _require(num_heads % num_kv_heads == 0, f"{op}: num_heads must be a multiple of num_kv_heads")
    _require(key_cache.shape[3] == head_dim, f"{op}: cache head size {key_cache.shape[3]} != query's {head_dim}")
    block_size = key_cache.shape[1]
    _require(block_size % 16 == 0, f"{op}: block_size {block_size} must be a multiple of 16")
    _require(block_table.dtype == torch.int32, f"{op}: block_table must be int32, got {block_table.dtype}")
    _require(
        block_table.dim() == 2 and block_table.shape[0] == batch, f"{op}: block_table must be [{batch}, max_blocks]"
    )
    _require(context_lens.dtype == torch.int32, f"{op}: context_lens must be int32, got {context_lens.dtype}")
    _require(context_lens.device.type == "cpu", f"{op}: context_lens is read on the host")
    _require(tuple(context_lens.shape) == (batch,), f"{op}: context_lens must be [{batch}]")
    lens = context_lens.long()
    _require(bool((lens >= 1).all()), f"{op}: every context length must be >= 1")
    _require(int(lens.max()) <= block_table.shape[1] * block_size, f"{op}: context longer than its block table")
    _require(out.shape == query.shape and out.dtype == query.dtype, f"{op}: out must match query")
    result = attention.paged_attention(
        query.float(),
        key_cache.float(),
        value_cache.float(),
        block_table.long(),
        lens,
        torch.arange(batch + 1),
        scale_value,
    )
    out.copy_(result)


# ---- fused infer attention ------------------------------------------------------------------------


def _check_causal_mask(mask: torch.Tensor | None) -> None:
    op = "npu_fused_infer_attention_score"
    if mask is None:
        raise FakeNpuOpError(f"{op}: sparse_mode 3 needs the optimised 2048x2048 atten_mask")
    _require(mask.dtype in MASK_DTYPES, f"{op}: atten_mask dtype {mask.dtype} not supported")
    _require(mask.shape[-2:] == (2048, 2048) and mask.numel() == 2048 * 2048, f"{op}: atten_mask must be 2048x2048")
    expected = torch.ones(2048, 2048, dtype=torch.bool).triu(diagonal=1)
    _require(torch.equal(mask.reshape(2048, 2048).bool(), expected), f"{op}: atten_mask must be triu(ones, diagonal=1)")


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    query_padding_size: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None,
    key_antiquant_scale: torch.Tensor | None = None,
    key_antiquant_offset: torch.Tensor | None = None,
    value_antiquant_scale: torch.Tensor | None = None,
    value_antiquant_offset: torch.Tensor | None = None,
    key_shared_prefix: torch.Tensor | None = None,
    value_shared_prefix: torch.Tensor | None = None,
    actual_shared_prefix_len: Sequence[int] | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    key_rope_antiquant_scale: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FIA with the TND layout over a paged cache [num_blocks, block_size, Hk * D]; returns (out, lse).

    Only what meshserve uses is modelled: TND queries, page attention, no quantisation/prefix/rope inputs,
    sparse_mode 3 (right-down causal with the 2048x2048 mask) or 0 without a mask.
    """
    op = "npu_fused_infer_attention_score"
    unmodelled = {
        "pse_shift": pse_shift,
        "dequant_scale1": dequant_scale1,
        "quant_scale1": quant_scale1,
        "dequant_scale2": dequant_scale2,
        "quant_scale2": quant_scale2,
        "quant_offset2": quant_offset2,
        "antiquant_scale": antiquant_scale,
        "antiquant_offset": antiquant_offset,
        "query_padding_size": query_padding_size,
        "kv_padding_size": kv_padding_size,
        "key_antiquant_scale": key_antiquant_scale,
        "key_antiquant_offset": key_antiquant_offset,
        "value_antiquant_scale": value_antiquant_scale,
        "value_antiquant_offset": value_antiquant_offset,
        "key_shared_prefix": key_shared_prefix,
        "value_shared_prefix": value_shared_prefix,
        "actual_shared_prefix_len": actual_shared_prefix_len,
        "query_rope": query_rope,
        "key_rope": key_rope,
        "key_rope_antiquant_scale": key_rope_antiquant_scale,
    }
    used = sorted(name for name, given in unmodelled.items() if given is not None)
    if used or input_layout != "TND" or block_table is None:
        raise NotImplementedError(f"fake {op} models TND + page attention only (got {input_layout}, {used})")
    # Validate like the kernel: layout, dtypes, heads, page-attention geometry.
    _require(query.dim() == 3, f"{op}: TND query must be [T, N, D], got {tuple(query.shape)}")
    _require(query.dtype in HALF_DTYPES, f"{op}: query dtype {query.dtype} not supported")
    _require(all(t.is_contiguous() for t in (query, key, value)), f"{op}: non-contiguous inputs are not supported")
    total, _, head_dim = query.shape
    _require(head_dim % 16 == 0, f"{op}: D={head_dim} must be 16-aligned for fp16/bf16")
    _require(num_heads == query.shape[1], f"{op}: num_heads={num_heads} but query has {query.shape[1]} heads")
    kv_heads = num_key_value_heads or num_heads
    _require(num_heads % kv_heads == 0 and num_heads // kv_heads <= 64, f"{op}: bad num_key_value_heads={kv_heads}")
    _require(key.shape == value.shape, f"{op}: key and value shapes differ")
    _require(key.dtype == value.dtype == query.dtype, f"{op}: key/value dtype must match query")
    _require(key.dim() == 3, f"{op}: paged key/value must be [num_blocks, block_size, H]")
    num_blocks = key.shape[0]
    _require(key.shape[2] == kv_heads * head_dim, f"{op}: key H={key.shape[2]} != num_key_value_heads * D")
    _require(block_size == key.shape[1], f"{op}: block_size={block_size} but the cache blocks hold {key.shape[1]}")
    _require(block_size % 128 == 0 and 128 <= block_size <= 512, f"{op}: block_size {block_size} unsupported")
    _require(block_table.dtype == torch.int32, f"{op}: block_table must be int32, got {block_table.dtype}")
    _require(block_table.dim() == 2, f"{op}: block_table must be 2-D")
    _require(actual_seq_lengths is not None and actual_seq_lengths_kv is not None, f"{op}: TND needs both lengths")
    q_ends = _int_list("actual_seq_lengths", actual_seq_lengths)
    kv_lens = _int_list("actual_seq_lengths_kv", actual_seq_lengths_kv)
    batch = len(q_ends)
    _require(block_table.shape[0] == batch, f"{op}: block_table has {block_table.shape[0]} rows for {batch} batches")
    _require(len(kv_lens) == batch, f"{op}: {len(kv_lens)} KV lengths for {batch} batches")
    starts = [0, *q_ends]
    _require(
        all(a <= b for a, b in zip(starts[:-1], q_ends, strict=True)), f"{op}: actual_seq_lengths must be cumulative"
    )
    _require(q_ends[-1] == total, f"{op}: actual_seq_lengths ends at {q_ends[-1]} but T={total}")
    _require(all(n >= 0 for n in kv_lens), f"{op}: negative KV length")
    _require(max(kv_lens) <= block_table.shape[1] * block_size, f"{op}: KV length exceeds the block table")
    _require(bool(((block_table >= 0) & (block_table < num_blocks)).all()), f"{op}: block id out of range")
    if sparse_mode == 3:
        _check_causal_mask(atten_mask)
        q_lens = [b - a for a, b in zip(starts[:-1], q_ends, strict=True)]
        _require(
            all(q <= kv for q, kv in zip(q_lens, kv_lens, strict=True)), f"{op}: a query chunk is longer than its KV"
        )
    elif sparse_mode != 0 or atten_mask is not None:
        raise NotImplementedError(f"fake {op} models sparse_mode 3 with mask, or 0 without, got {sparse_mode}")
    caches = [c.view(num_blocks, block_size, kv_heads, head_dim).float() for c in (key, value)]
    if sparse_mode == 3:
        out = attention.paged_attention(
            query.float(),
            caches[0],
            caches[1],
            block_table.long(),
            torch.tensor(kv_lens),
            torch.tensor(starts),
            scale,
        )
    else:
        out = _full_attention(query.float(), caches[0], caches[1], block_table.long(), kv_lens, starts, scale)
    lse = torch.zeros(1, dtype=torch.float32)
    if softmax_lse_flag:
        raise NotImplementedError(f"fake {op} does not compute softmax_lse")
    return out.to(query.dtype), lse


def _full_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: list[int],
    starts: list[int],
    scale: float,
) -> torch.Tensor:
    """sparse_mode 0 without a mask: every query sees all of its sequence's keys."""
    out = torch.empty_like(q)
    for b, kv_len in enumerate(kv_lens):
        rows = slice(starts[b], starts[b + 1])
        k = attention.gather_kv(k_cache, block_table[b], kv_len).transpose(0, 1)
        v = attention.gather_kv(v_cache, block_table[b], kv_len).transpose(0, 1)
        attn = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k, v, scale=scale, enable_gqa=True)
        out[rows] = attn.transpose(0, 1)
    return out


OPS: dict[str, Callable[..., Any]] = {
    "npu_rms_norm": npu_rms_norm,
    "npu_add_rms_norm": npu_add_rms_norm,
    "npu_swiglu": npu_swiglu,
    "npu_apply_rotary_pos_emb": npu_apply_rotary_pos_emb,
    "_npu_reshape_and_cache": _npu_reshape_and_cache,
    "_npu_paged_attention": _npu_paged_attention,
    "npu_fused_infer_attention_score": npu_fused_infer_attention_score,
}


# ---- torch.npu ------------------------------------------------------------------------------------


class FakeNpuRuntime:
    """The torch.npu namespace: device queries and allocator statistics, recording what was called."""

    def __init__(
        self,
        device_count: int = 8,
        *,
        free_bytes: int = 60 * GiB,
        total_bytes: int = 64 * GiB,
        error: BaseException | None = None,
    ) -> None:
        self._device_count = device_count
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        self.peak_bytes = 3 * GiB
        # Raised by is_available/device_count, as ACL failures surface on the first device query.
        self.error = error
        self.current = 0
        self.calls: list[tuple[str, object]] = []

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def is_available(self) -> bool:
        self._check()
        return self._device_count > 0

    def device_count(self) -> int:
        self._check()
        return self._device_count

    def set_device(self, device: int | str | torch.device) -> None:
        self.calls.append(("set_device", device))
        self.current = device if isinstance(device, int) else torch.device(device).index or 0

    def current_device(self) -> int:
        return self.current

    def mem_get_info(self, device: int | torch.device | None = None) -> tuple[int, int]:
        self.calls.append(("mem_get_info", device))
        return self.free_bytes, self.total_bytes

    def synchronize(self, device: int | torch.device | None = None) -> None:
        self.calls.append(("synchronize", device))

    def reset_peak_memory_stats(self, device: int | torch.device | None = None) -> None:
        self.calls.append(("reset_peak_memory_stats", device))

    def max_memory_allocated(self, device: int | torch.device | None = None) -> int:
        self.calls.append(("max_memory_allocated", device))
        return self.peak_bytes

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", None))


class FakeTorchNpu(types.ModuleType):
    """The fake torch_npu module: the ops as attributes, npu = the runtime, calls = op call counts."""

    def __init__(self, runtime: FakeNpuRuntime) -> None:
        super().__init__("torch_npu")
        self.__spec__ = ModuleSpec("torch_npu", loader=None)
        self.npu = runtime
        self.calls: Counter[str] = Counter()
        for name, fn in OPS.items():
            setattr(self, name, self._counted(name, fn))

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return op


def make_module(device_count: int = 8, *, runtime_error: BaseException | None = None) -> FakeTorchNpu:
    """A fresh fake module (not installed anywhere): for NpuOps(module) tests."""
    return FakeTorchNpu(FakeNpuRuntime(device_count, error=runtime_error))


class _FailingImport(importlib.abc.MetaPathFinder):
    """Makes `import torch_npu` raise a given error, as a broken Ascend install does."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None) -> None:
        if fullname == "torch_npu" or fullname.startswith("torch_npu."):
            raise self.error
        return None


def install(
    monkeypatch: pytest.MonkeyPatch,
    *,
    device_count: int = 8,
    import_error: BaseException | None = None,
    runtime_error: BaseException | None = None,
) -> FakeTorchNpu:
    """Make `import torch_npu` return the fake and register torch.npu, undone after the test.

    With import_error the import raises it instead (and torch.npu stays absent). Like the real import, this
    renames torch's privateuse1 backend to "npu" so torch.device("npu", i) parses; that rename is process-wide
    and cannot be undone, which is harmless since nothing else in the tests uses privateuse1.
    """
    module = make_module(device_count, runtime_error=runtime_error)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.delattr(torch, "npu", raising=False)
    if import_error is not None:
        monkeypatch.setattr(sys, "meta_path", [_FailingImport(import_error), *sys.meta_path])
        return module
    torch.utils.rename_privateuse1_backend("npu")
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", module.npu, raising=False)
    return module
