"""NPU platform on a fake torch_npu: fused-op dispatch against the reference ops, the probe, the platform."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from services.worker.layers import attention
from services.worker.layers.rotary import RotaryTable
from services.worker.platforms.base import DeviceUnavailableError, MemoryInfo
from services.worker.platforms.npu import (
    ALLOC_CONF_ENV,
    DEFAULT_ALLOC_CONF,
    VISIBLE_DEVICES_ENV,
    NpuOps,
    NpuPlatform,
    npu_unavailable_message,
    probe_npu,
)
from services.worker.platforms.reference_ops import ReferenceOps
from tests.support import fake_torch_npu
from tests.support.fake_torch_npu import FakeNpuOpError, FakeTorchNpu, GiB

REF = ReferenceOps()
SET_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # setenv before delenv so the undo restores the original state even after probe_npu writes the variable.
    for name in (ALLOC_CONF_ENV, VISIBLE_DEVICES_ENV):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


@pytest.fixture
def fake() -> FakeTorchNpu:
    return fake_torch_npu.make_module()


@pytest.fixture
def ops(fake: FakeTorchNpu) -> NpuOps:
    return NpuOps(fake)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 to 1e-5; fp16/bf16 to torch's per-dtype defaults (about one rounding step)."""
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(actual, expected)


def _randn(*shape: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


# ---- norms, rotary, activation ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_reference(ops: NpuOps, fake: FakeTorchNpu, dtype: torch.dtype) -> None:
    g = _gen(0)
    x = _randn(7, 64, g=g, dtype=dtype)
    w = (torch.rand(64, generator=g) + 0.5).to(dtype)
    out = ops.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and fake.calls["npu_rms_norm"] == 1
    _assert_close(out, REF.rms_norm(x, w, 1e-6))


def test_rms_norm_promotes_mixed_dtypes_like_the_reference(ops: NpuOps) -> None:
    g = _gen(1)
    x = _randn(4, 32, g=g, dtype=torch.bfloat16)
    w = torch.rand(32, generator=g) + 0.5
    expected = REF.rms_norm(x, w, 1e-5)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_reference(ops: NpuOps, fake: FakeTorchNpu, dtype: torch.dtype) -> None:
    g = _gen(2)
    x, residual = _randn(5, 48, g=g, dtype=dtype), _randn(5, 48, g=g, dtype=dtype)
    w = (torch.rand(48, generator=g) + 0.5).to(dtype)
    normed, summed = ops.add_rms_norm(x, residual, w, 1e-6)
    ref_normed, ref_summed = REF.add_rms_norm(x, residual, w, 1e-6)
    assert fake.calls["npu_add_rms_norm"] == 1
    _assert_close(summed, ref_summed)
    _assert_close(normed, ref_normed)


def _rotary_inputs(
    head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    positions = torch.randint(0, 512, (6,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = RotaryTable(inv_freq, 512).lookup(positions)
    return _randn(6, 4, head_dim, g=g, dtype=dtype), _randn(6, 2, head_dim, g=g, dtype=dtype), cos, sin


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_reference_and_leaves_inputs(
    ops: NpuOps, fake: FakeTorchNpu, head_dim: int, dtype: torch.dtype
) -> None:
    q, k, cos, sin = _rotary_inputs(head_dim, dtype, seed=3)
    q_before, k_before = q.clone(), k.clone()
    out_q, out_k = ops.apply_rotary(q, k, cos, sin)
    # cos/sin go in as q's dtype; the kernel computes in fp32 and rounds once: the oracle is the reference on
    # fp32 copies of exactly those inputs.
    cos_in, sin_in = cos.to(dtype).float(), sin.to(dtype).float()
    ref_q, ref_k = (t.to(dtype) for t in REF.apply_rotary(q.float(), k.float(), cos_in, sin_in))
    assert fake.calls["npu_apply_rotary_pos_emb"] == 1
    assert out_q.shape == q.shape and out_k.shape == k.shape and out_q.dtype == dtype
    _assert_close(out_q, ref_q)
    _assert_close(out_k, ref_k)
    # The kernel rotates in place; the op table must not touch the caller's tensors.
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_apply_rotary_on_views_of_a_fused_qkv(ops: NpuOps) -> None:
    g = _gen(4)
    qkv = _randn(6, 4 + 2 + 2, 64, g=g, dtype=torch.bfloat16)
    qkv_before = qkv.clone()
    q, k = qkv[:, :4], qkv[:, 4:6]
    _, _, cos, sin = _rotary_inputs(64, torch.bfloat16, seed=4)
    out_q, out_k = ops.apply_rotary(q, k, cos, sin)
    cos_in, sin_in = cos.bfloat16().float(), sin.bfloat16().float()
    ref_q, ref_k = (t.bfloat16() for t in REF.apply_rotary(q.float(), k.float(), cos_in, sin_in))
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
    assert torch.equal(qkv, qkv_before)


def test_apply_rotary_other_head_sizes_take_the_reference(ops: NpuOps, fake: FakeTorchNpu) -> None:
    q, k, cos, sin = _rotary_inputs(32, torch.float32, seed=5)
    out_q, out_k = ops.apply_rotary(q, k, cos, sin)
    ref_q, ref_k = REF.apply_rotary(q, k, cos, sin)
    assert fake.calls["npu_apply_rotary_pos_emb"] == 0
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(ops: NpuOps, fake: FakeTorchNpu, dtype: torch.dtype) -> None:
    g = _gen(6)
    x = _randn(5, 96, g=g, dtype=dtype)
    _assert_close(ops.silu_and_mul(x), REF.silu_and_mul(x))
    # A non-contiguous input (the kernel rejects those) is made contiguous first.
    xt = _randn(96, 5, g=g, dtype=dtype).t()
    _assert_close(ops.silu_and_mul(xt), REF.silu_and_mul(xt))
    assert fake.calls["npu_swiglu"] == 2


# ---- paged KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_matches_reference(
    ops: NpuOps, fake: FakeTorchNpu, dtype: torch.dtype, slot_dtype: torch.dtype
) -> None:
    g = _gen(7)
    k_cache = _randn(5, 128, 2, 32, g=g, dtype=dtype)
    v_cache = _randn(5, 128, 2, 32, g=g, dtype=dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    k, v = _randn(50, 2, 32, g=g, dtype=dtype), _randn(50, 2, 32, g=g, dtype=dtype)
    slots = torch.randperm(5 * 128, generator=g)[:50].to(slot_dtype)
    ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    REF.reshape_and_cache(k, v, ref_k, ref_v, slots.long())
    assert fake.calls["_npu_reshape_and_cache"] == 1
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_reshape_and_cache_fp32_cache_takes_the_reference(ops: NpuOps, fake: FakeTorchNpu) -> None:
    g = _gen(8)
    k_cache, v_cache = torch.zeros(2, 128, 1, 16), torch.zeros(2, 128, 1, 16)
    k, v = _randn(3, 1, 16, g=g), _randn(3, 1, 16, g=g)
    ops.reshape_and_cache(k, v, k_cache, v_cache, torch.tensor([5, 130, 0]))
    assert fake.calls["_npu_reshape_and_cache"] == 0
    assert torch.equal(k_cache[1, 2], k[1]) and torch.equal(v_cache[0, 0], v[2])


@dataclass
class PagedCase:
    """A varlen batch over a paged cache: the arguments of Ops.paged_attention."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self) -> tuple[Any, ...]:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc, self.scale)

    def expected(self) -> torch.Tensor:
        """The reference on fp32 copies of the same values, rounded to q's dtype."""
        q, k, v = (t.float() for t in (self.q, self.k_cache, self.v_cache))
        out = REF.paged_attention(q, k, v, self.block_tables, self.seq_lens, self.query_start_loc, self.scale)
        return out.to(self.q.dtype)


def make_case(
    shapes: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> PagedCase:
    """(context already cached, new query tokens) per sequence; blocks scattered, tables padded with 0."""
    g = _gen(seed)
    needed = [math.ceil((c + n) / block_size) for c, n in shapes]
    num_blocks = sum(needed) + 3
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for (context, num_query), count in zip(shapes, needed, strict=True):
        length = context + num_query
        blocks = [perm.pop() for _ in range(count)]
        tables.append(blocks)
        k = _randn(length, num_kv_heads, head_dim, g=g, dtype=dtype)
        v = _randn(length, num_kv_heads, head_dim, g=g, dtype=dtype)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(length)])
        attention.reshape_and_cache(k, v, k_cache, v_cache, slots)
    width = max(needed) + 1
    starts = [0]
    for _, num_query in shapes:
        starts.append(starts[-1] + num_query)
    return PagedCase(
        q=_randn(starts[-1], num_heads, head_dim, g=g, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor([c + n for c, n in shapes]),
        query_start_loc=torch.tensor(starts),
        scale=head_dim**-0.5,
    )


# Seq lens cross block boundaries (129, 140, 260), end exactly on one (256), and start inside the first block.
ALL_DECODE = [(128, 1), (0, 1), (255, 1), (300, 1)]
PURE_PREFILL = [(0, 130), (0, 7)]
MIXED = [(0, 5), (120, 20), (127, 1), (0, 1), (250, 10)]
CHUNK_WITH_CONTEXT = [(200, 60)]


@pytest.mark.parametrize(
    ("shapes", "kernel"),
    [
        (ALL_DECODE, "_npu_paged_attention"),
        (PURE_PREFILL, "npu_fused_infer_attention_score"),
        (MIXED, "npu_fused_infer_attention_score"),
        (CHUNK_WITH_CONTEXT, "npu_fused_infer_attention_score"),
    ],
    ids=["all-decode", "pure-prefill", "mixed", "chunk-with-context"],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_matches_reference(
    ops: NpuOps,
    fake: FakeTorchNpu,
    shapes: list[tuple[int, int]],
    kernel: str,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
) -> None:
    case = make_case(shapes, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype, seed=len(shapes))
    out = ops.paged_attention(*case.args())
    assert fake.calls[kernel] == 1 and sum(fake.calls.values()) == 1
    assert out.shape == case.q.shape and out.dtype == dtype
    torch.testing.assert_close(out, case.expected())


def test_paged_attention_with_256_token_blocks(ops: NpuOps, fake: FakeTorchNpu) -> None:
    case = make_case(MIXED, block_size=256, seed=9)
    torch.testing.assert_close(ops.paged_attention(*case.args()), case.expected())
    assert fake.calls["npu_fused_infer_attention_score"] == 1


def test_paged_attention_int32_tables_from_the_caller(ops: NpuOps) -> None:
    case = make_case(ALL_DECODE, seed=10)
    case.block_tables = case.block_tables.int()
    case.seq_lens = case.seq_lens.int()
    torch.testing.assert_close(ops.paged_attention(*case.args()), case.expected())


def test_paged_attention_fp32_takes_the_reference(ops: NpuOps, fake: FakeTorchNpu) -> None:
    case = make_case(MIXED, dtype=torch.float32, seed=11)
    out = ops.paged_attention(*case.args())
    assert sum(fake.calls.values()) == 0
    torch.testing.assert_close(out, REF.paged_attention(*case.args()), atol=1e-5, rtol=1e-5)


def test_paged_attention_rejects_unaligned_block_size(ops: NpuOps) -> None:
    case = make_case(PURE_PREFILL, block_size=64, seed=12)
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.paged_attention(*case.args())


# ---- the fake is strict enough to catch wrong calls ----------------------------------------------------


class SwappedCachesOps(NpuOps):
    """Passes the value cache as keys and the key cache as values."""

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
        return super().paged_attention(q, v_cache, k_cache, block_tables, seq_lens, query_start_loc, scale)


class SwappedHeadsOps(NpuOps):
    """Calls the decode kernel with num_heads and num_kv_heads exchanged."""

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
        out = torch.empty_like(q)
        self._npu._npu_paged_attention(
            query=q,
            key_cache=k_cache,
            value_cache=v_cache,
            num_kv_heads=q.shape[1],
            num_heads=k_cache.shape[2],
            scale_value=scale,
            block_table=block_tables.int(),
            context_lens=seq_lens.int(),
            out=out,
        )
        return out


class Int64SlotsOps(NpuOps):
    """Hands the int64 slot mapping straight to the kernel."""

    def reshape_and_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._npu._npu_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def test_fake_catches_swapped_caches(fake: FakeTorchNpu) -> None:
    case = make_case(MIXED, seed=13)
    out = SwappedCachesOps(fake).paged_attention(*case.args())
    assert not torch.allclose(out.float(), case.expected().float(), atol=1e-2)


def test_fake_catches_swapped_head_counts(fake: FakeTorchNpu) -> None:
    case = make_case(ALL_DECODE, num_heads=8, num_kv_heads=2, seed=14)
    with pytest.raises(FakeNpuOpError, match="num_heads=2"):
        SwappedHeadsOps(fake).paged_attention(*case.args())


def test_fake_catches_int64_slots(fake: FakeTorchNpu) -> None:
    k_cache = torch.zeros(2, 128, 1, 16, dtype=torch.bfloat16)
    k = torch.ones(2, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(FakeNpuOpError, match="int32"):
        Int64SlotsOps(fake).reshape_and_cache(k, k, k_cache, k_cache.clone(), torch.tensor([0, 1]))


def _fia_kwargs(case: PagedCase, fake: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The arguments NpuOps hands npu_fused_infer_attention_score for case, by name, to break one at a time."""
    calls: list[dict[str, Any]] = []
    real = fake.npu_fused_infer_attention_score

    def spy(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
        calls.append({"query": query, "key": key, "value": value, **kwargs})
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(fake, "npu_fused_infer_attention_score", spy)
    NpuOps(fake).paged_attention(*case.args())
    monkeypatch.setattr(fake, "npu_fused_infer_attention_score", real)
    assert len(calls) == 1
    return calls[0]


FIA_BREAKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "int64 block table": lambda kw: kw.update(block_table=kw["block_table"].long()),
    "per-sequence query lengths": lambda kw: kw.update(
        actual_seq_lengths=[
            b - a for a, b in zip([0, *kw["actual_seq_lengths"]], kw["actual_seq_lengths"], strict=False)
        ]
    ),
    "cumulative kv lengths": lambda kw: kw.update(
        actual_seq_lengths_kv=torch.tensor(kw["actual_seq_lengths_kv"]).cumsum(0).tolist()
    ),
    "heads swapped": lambda kw: kw.update(num_heads=kw["num_key_value_heads"], num_key_value_heads=kw["num_heads"]),
    "lower-triangular mask": lambda kw: kw.update(atten_mask=kw["atten_mask"].t().contiguous()),
    "no mask": lambda kw: kw.update(atten_mask=None),
    "block size": lambda kw: kw.update(block_size=64),
    "4-D caches": lambda kw: kw.update(key=kw["key"].view(*kw["key"].shape[:2], -1, 32)),
}


@pytest.mark.parametrize("name", list(FIA_BREAKS))
def test_fake_fia_rejects_wrong_arguments(fake: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    case = make_case(MIXED, seed=15)
    kwargs = _fia_kwargs(case, fake, monkeypatch)
    out, _ = fake.npu_fused_infer_attention_score(**kwargs)
    torch.testing.assert_close(out, case.expected())
    FIA_BREAKS[name](kwargs)
    with pytest.raises(FakeNpuOpError):
        fake.npu_fused_infer_attention_score(**kwargs)


def test_fake_fia_takes_only_q_k_v_positionally(fake: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = _fia_kwargs(make_case(PURE_PREFILL, seed=16), fake, monkeypatch)
    with pytest.raises(TypeError):
        fake.npu_fused_infer_attention_score(
            kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value"), None, **kwargs
        )


def test_fake_rotary_and_norm_reject_wrong_layouts(fake: FakeTorchNpu) -> None:
    q, k, cos, sin = _rotary_inputs(64, torch.bfloat16, seed=17)
    q4, k4 = q.unsqueeze(0), k.unsqueeze(0)
    cos4, sin4 = cos.bfloat16().view(1, 6, 1, 64), sin.bfloat16().view(1, 6, 1, 64)
    fake.npu_apply_rotary_pos_emb(q4.clone(), k4.clone(), cos4, sin4)
    with pytest.raises(FakeNpuOpError, match="4-D"):
        fake.npu_apply_rotary_pos_emb(q, k, cos4, sin4)
    with pytest.raises(FakeNpuOpError, match="dtype"):
        fake.npu_apply_rotary_pos_emb(q4.clone(), k4.clone(), cos4.float(), sin4.float())
    with pytest.raises(FakeNpuOpError, match=r"\(B, S, 1, D\)"):
        fake.npu_apply_rotary_pos_emb(q4.clone(), k4.clone(), cos4.view(6, 1, 1, 64), sin4.view(6, 1, 1, 64))
    with pytest.raises(FakeNpuOpError, match="gamma dtype"):
        fake.npu_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)


def test_fake_decode_kernel_rejects_wrong_dtypes(fake: FakeTorchNpu) -> None:
    case = make_case(ALL_DECODE, seed=18)
    kwargs: dict[str, Any] = {
        "query": case.q,
        "key_cache": case.k_cache,
        "value_cache": case.v_cache,
        "num_kv_heads": case.k_cache.shape[2],
        "num_heads": case.q.shape[1],
        "scale_value": case.scale,
        "block_table": case.block_tables.int(),
        "context_lens": case.seq_lens.int(),
        "out": torch.empty_like(case.q),
    }
    fake._npu_paged_attention(**kwargs)
    torch.testing.assert_close(kwargs["out"], case.expected())
    for name in ("block_table", "context_lens"):
        broken = {**kwargs, name: kwargs[name].long()}
        with pytest.raises(FakeNpuOpError, match=f"{name} must be int32"):
            fake._npu_paged_attention(**broken)


# ---- probe ------------------------------------------------------------------------------------------


def test_probe_with_fake_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_npu.install(monkeypatch, device_count=4)
    probe = probe_npu()
    assert (probe.available, probe.device_count, probe.error) == (True, 4, None)


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (ModuleNotFoundError("No module named 'torch_npu'"), "deploy/docker/Dockerfile.ascend"),
        (OSError("libhccl.so: cannot open shared object file: No such file or directory"), "CANN libraries"),
        (RuntimeError("aclrtSetDevice failed: ACL_ERROR_DEVICE_NOT_FOUND"), "No Ascend device"),
    ],
    ids=["no-torch-npu", "no-cann", "no-device"],
)
def test_probe_keeps_import_errors(monkeypatch: pytest.MonkeyPatch, error: BaseException, hint: str) -> None:
    fake_torch_npu.install(monkeypatch, import_error=error)
    probe = probe_npu()
    assert not probe.available and probe.device_count == 0
    assert probe.error == f"{type(error).__name__}: {error}"
    message = npu_unavailable_message(probe.error)
    for needle in (str(error), hint, SET_ENV, "npu-smi info", "--device cpu"):
        assert needle in message


def test_probe_keeps_device_query_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_npu.install(monkeypatch, runtime_error=RuntimeError("NPU function error, error code is 507033"))
    probe = probe_npu()
    assert not probe.available
    assert probe.error == "RuntimeError: NPU function error, error code is 507033"
    assert "No Ascend device" in npu_unavailable_message(probe.error)


def test_probe_zero_devices_names_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_npu.install(monkeypatch, device_count=0)
    probe = probe_npu()
    assert not probe.available and probe.error is not None and VISIBLE_DEVICES_ENV not in probe.error
    monkeypatch.setenv(VISIBLE_DEVICES_ENV, "")
    probe = probe_npu()
    assert probe.error is not None and f"{VISIBLE_DEVICES_ENV}=''" in probe.error
    assert "npu-smi info" in npu_unavailable_message(probe.error)


def test_probe_sets_alloc_conf_unless_the_user_did(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    fake_torch_npu.install(monkeypatch)
    probe_npu()
    assert os.environ[ALLOC_CONF_ENV] == DEFAULT_ALLOC_CONF
    monkeypatch.setenv(ALLOC_CONF_ENV, "expandable_segments:False")
    probe_npu()
    assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:False"


def test_probe_sets_alloc_conf_even_when_the_import_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    fake_torch_npu.install(monkeypatch, import_error=ModuleNotFoundError("No module named 'torch_npu'"))
    probe_npu()
    assert os.environ[ALLOC_CONF_ENV] == DEFAULT_ALLOC_CONF


# ---- platform ---------------------------------------------------------------------------------------


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTorchNpu]:
    yield fake_torch_npu.install(monkeypatch, device_count=8)


def test_platform_on_the_probe_path(installed: FakeTorchNpu) -> None:
    platform = NpuPlatform(local_rank=1)
    assert (platform.name, platform.dist_backend) == ("npu", "hccl")
    assert platform.required_block_size == 128 and platform.default_precision == "bf16-fp16-fp32"
    assert platform.device == torch.device("npu", 1) and str(platform.device) == "npu:1"
    assert isinstance(platform.ops, NpuOps)
    platform.set_device()
    assert ("set_device", 1) in installed.npu.calls and installed.npu.current_device() == 1
    assert platform.device_count() == 8


def test_platform_memory_and_allocator_calls(installed: FakeTorchNpu) -> None:
    platform = NpuPlatform(local_rank=2)
    assert platform.memory_info() == MemoryInfo(free_bytes=60 * GiB, total_bytes=64 * GiB)
    platform.reset_peak_memory()
    assert platform.peak_memory_bytes() == 3 * GiB
    platform.synchronize()
    platform.empty_cache()
    assert installed.npu.calls == [
        ("mem_get_info", 2),
        ("reset_peak_memory_stats", 2),
        ("max_memory_allocated", 2),
        ("synchronize", 2),
        ("empty_cache", None),
    ]


def test_platform_with_an_injected_module(installed: FakeTorchNpu) -> None:
    platform = NpuPlatform(local_rank=0, torch_npu_module=installed)
    x = torch.randn(3, 16)
    torch.testing.assert_close(platform.ops.rms_norm(x, torch.ones(16), 1e-6), REF.rms_norm(x, torch.ones(16), 1e-6))
    assert installed.calls["npu_rms_norm"] == 1


def test_platform_rank_beyond_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_npu.install(monkeypatch, device_count=2)
    monkeypatch.setenv(VISIBLE_DEVICES_ENV, "4,5")
    with pytest.raises(DeviceUnavailableError) as info:
        NpuPlatform(local_rank=2)
    message = str(info.value)
    assert f"{VISIBLE_DEVICES_ENV}=4,5" in message and "npu-smi info" in message and "npu:2" in message


def test_platform_unavailable_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_npu.install(monkeypatch, import_error=OSError("libascendcl.so: cannot open shared object file"))
    with pytest.raises(DeviceUnavailableError) as info:
        NpuPlatform()
    assert "libascendcl.so" in str(info.value) and SET_ENV in str(info.value)


def test_platform_out_of_memory_detection(installed: FakeTorchNpu) -> None:
    platform = NpuPlatform()
    assert platform.is_out_of_memory(torch.OutOfMemoryError("NPU out of memory"))
    assert platform.is_out_of_memory(
        RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.00 GiB total capacity; ...)")
    )
    assert not platform.is_out_of_memory(RuntimeError("ACL stream synchronize failed"))
    assert not platform.is_out_of_memory(ValueError("NPU out of memory"))
