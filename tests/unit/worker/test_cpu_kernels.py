"""Native CPU kernels (services/worker/kernels) against the pure-torch reference ops they replace."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch

from services.worker.kernels import loader
from services.worker.layers import activation, norm, rotary
from services.worker.layers.attention import (
    HND,
    NHD,
    cache_shape,
    decode_attention,
    head_major,
    prefill_attention,
    reshape_and_cache,
)
from services.worker.layers.quantization import (
    HalfWeight,
    QuantizedWeight,
    int8_rounded_row_reference,
    quantize_int4,
    quantize_int8,
    quantized_linear_reference,
    tile_half_weight,
    tile_int8_weight,
)
from services.worker.platforms.base import DeviceUnavailableError
from services.worker.platforms.cpu import CpuPlatform, cpu_ops
from services.worker.platforms.cpu_native_ops import NativeCpuOps
from services.worker.platforms.reference_ops import ReferenceOps

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def native() -> NativeCpuOps:
    loader.load()
    return NativeCpuOps(HND)


def _ulp_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to one unit in the last place of the dtype (reductions may sum in another order)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_the_reference(native: NativeCpuOps, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    residual = torch.randn(37, 576, generator=g).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    _ulp_close(native.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5))
    out, new_residual = native.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = norm.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)
    _ulp_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_and_rotary_round_as_the_reference(native: NativeCpuOps, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(19, 2 * 1536, generator=g) * 4).to(dtype)
    _ulp_close(native.silu_and_mul(gate_up), activation.silu_and_mul(gate_up))
    q = torch.randn(19, 9, 64, generator=g).to(dtype)
    k = torch.randn(19, 3, 64, generator=g).to(dtype)
    table = rotary.RotaryTable(1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64)), 4096)
    cos, sin = table.lookup(torch.randint(0, 4096, (19,), generator=g))
    for got, want in zip(native.apply_rotary(q, k, cos, sin), rotary.apply_rotary(q, k, cos, sin), strict=True):
        _ulp_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 32, 20])
def test_rotary_is_bit_identical_to_the_reference(native: NativeCpuOps, dtype: torch.dtype, head_dim: int) -> None:
    # 64 and 32: the vector path (half the head dim a whole number of vectors); 20: the scalar loop. Half
    # precision only: each product is rounded to the dtype, as torch rounds it; in fp32 the compiler may
    # fuse a product and the sum into one FMA (within an ulp: the test above).
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(23, 15, head_dim, generator=g).to(dtype)
    # q and k as strided slices of one fused tensor, as the attention layer passes them.
    q, k = qkv[:, :12], qkv[:, 12:]
    table = rotary.RotaryTable(1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 4096)
    cos, sin = table.lookup(torch.randint(0, 4096, (23,), generator=g))
    for got, want in zip(native.apply_rotary(q, k, cos, sin), rotary.apply_rotary(q, k, cos, sin), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1536, 1000, 37])
def test_silu_and_mul_is_bit_identical_to_the_reference(native: NativeCpuOps, dtype: torch.dtype, width: int) -> None:
    # 1536: whole vectors; 1000 and 37: a part-filled last one. Half precision: silu is rounded to the dtype
    # before the multiply, as F.silu's output is. (In fp32 torch's own tail loop calls std::exp, so the last
    # few values may differ by an ulp: the test above.)
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(7, 2 * width, generator=g) * 4).to(dtype)
    got, want = native.silu_and_mul(gate_up), activation.silu_and_mul(gate_up)
    assert got.dtype == want.dtype and torch.equal(got, want)


def _paged_batch(
    lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] (one query token per sequence) and caches holding each sequence in shuffled blocks,
    unused slots zero; tables padded with block 0."""
    q, k_cache, v_cache, tables, seq_lens, _ = _prefill_batch(
        lens, [1] * len(lens), num_heads, num_kv_heads, head_dim, layout, dtype, poison_unused=False
    )
    return q, k_cache, v_cache, tables, seq_lens


@pytest.mark.parametrize("layout", [HND, NHD])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 64), (8, 1, 128), (16, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Lengths on, just past and just short of block edges, a single token, and one long sequence: six sequences are
# a task per (sequence, KV head); twenty-four (the lengths four times) a task per sequence, its KV heads in turn.
@pytest.mark.parametrize("repeat", [1, 4])
def test_decode_attention_matches_the_reference(
    native: NativeCpuOps,
    layout: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    repeat: int,
) -> None:
    lens = [1, 15, 16, 17, 33, 300] * repeat
    q, k_cache, v_cache, tables, seq_lens = _paged_batch(lens, num_heads, num_kv_heads, head_dim, layout, dtype)
    scale = head_dim**-0.5
    # The kernel reads caches whose unused slots hold huge keys and NaN values: the AMX scores pass multiplies a
    # last block's rows past the sequence's end too (bf16 on an AMX host), and must never let them in.
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    block_size = head_major(k_cache, layout).shape[2]
    unused = torch.ones(k_cache.shape[0], block_size, dtype=torch.bool)
    for b, n in enumerate(lens):
        for position in range(n):
            unused[tables[b, position // block_size], position % block_size] = False
    head_major(k_poisoned, layout).masked_fill_(unused[:, None, :, None], 3e4)
    head_major(v_poisoned, layout).masked_fill_(unused[:, None, :, None], float("nan"))
    got = torch.ops.meshserve_cpu.paged_decode_attention(
        q, head_major(k_poisoned, layout), head_major(v_poisoned, layout), tables, seq_lens, scale
    )
    # The reference in float32 is the truth; the native kernel keeps scores in float32 too.
    truth = decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, scale, layout)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), truth, rtol=tolerance, atol=tolerance)
    assert got.dtype == dtype


def test_paged_attention_mixes_native_decodes_with_native_prefills(native: NativeCpuOps) -> None:
    """A step with prefill chunks and decodes: NativeCpuOps equals ReferenceOps row for row."""
    lens = [40, 1, 70, 23]
    _, k_cache, v_cache, tables, seq_lens = _paged_batch(lens, 9, 3, 64, HND, torch.float32)
    # Sequences 0 and 2 run query chunks of 5 and 12 tokens; 1 and 3 decode one.
    counts = [5, 1, 12, 1]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(sum(counts), 9, 64, generator=g)
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    args = (q, k_cache, v_cache, tables, seq_lens, starts, 0.125)
    torch.testing.assert_close(native.paged_attention(*args), ReferenceOps(HND).paged_attention(*args))


def _prefill_batch(
    lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str,
    dtype: torch.dtype,
    block_size: int = 16,
    *,
    poison_unused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] (each sequence's last query_lens[b] tokens), caches with the sequences in shuffled blocks,
    tables, seq_lens and query_start_loc. With poison_unused the unused slots hold huge keys and NaN values
    (a reused block holds anything; the padded decode reference reads them, so its tests get zeros)."""
    g = torch.Generator().manual_seed(sum(lens) + sum(query_lens) + num_heads + head_dim)
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 4
    shape = cache_shape(num_blocks, block_size, num_kv_heads, head_dim, layout)
    k_cache = torch.full(shape, 3e4 if poison_unused else 0.0).to(dtype)
    v_cache = torch.full(shape, float("nan") if poison_unused else 0.0).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lens:
        blocks = [free.pop() for _ in range(math.ceil(n / block_size))]
        tables.append(blocks)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g)
        reshape_and_cache(k.to(dtype), v.to(dtype), k_cache, v_cache, slots, layout)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    q = (torch.randn(sum(query_lens), num_heads, head_dim, generator=g) * 3).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(lens), starts


@pytest.mark.parametrize("layout", [HND, NHD])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 64), (8, 1, 128), (16, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_the_reference(
    native: NativeCpuOps, layout: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    # Whole prompts and chunks after a cached context; query lengths around the kernel's 16-token tiles and
    # its 64-key steps (one short of, on and past them), lengths ending mid-block, a decode among them, and
    # one 300-token prompt.
    lens = [40, 1, 70, 23, 300, 17, 16, 129, 65]
    query_lens = [40, 1, 12, 5, 300, 2, 16, 33, 64]
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_batch(
        lens, query_lens, num_heads, num_kv_heads, head_dim, layout, dtype
    )
    scale = head_dim**-0.5
    got = torch.ops.meshserve_cpu.paged_prefill_attention(
        q, head_major(k_cache, layout), head_major(v_cache, layout), tables, seq_lens, starts, scale
    )
    # The reference in float32 is the truth; the kernel keeps scores and softmax in float32 too.
    truth = prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, starts, scale, layout)
    prefill_rows = torch.ones(q.shape[0], dtype=torch.bool)
    prefill_rows[starts[1]] = False  # the decode's row is the decode kernel's
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert got.dtype == dtype and not got[prefill_rows].isnan().any()
    torch.testing.assert_close(got[prefill_rows].float(), truth[prefill_rows], rtol=tolerance, atol=tolerance)


def test_chunks_of_sdpa_prefill_pairs_and_more_go_to_torchs_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.layers import attention as attention_module
    from services.worker.platforms.cpu_native_ops import causal_pairs

    lens = [40, 1, 70, 23, 300, 17, 16, 129, 65]
    query_lens = [40, 1, 12, 5, 300, 2, 16, 33, 64]
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_batch(lens, query_lens, 9, 3, 64, HND, torch.bfloat16)
    sdpa_lens: list[int] = []
    original = attention_module.prefill_attention

    def recording(*args: object) -> torch.Tensor:
        sdpa_lens.append(int(args[4].item()))  # type: ignore[attr-defined]
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_module, "prefill_attention", recording)
    loader.load()
    split = NativeCpuOps(HND, sdpa_prefill_pairs=2000)
    got = split.prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.125, HND)
    # 300 x 300, 33 after 96 and 64 after 1 are 2,000 pairs or more; a one-token chunk never is.
    assert sorted(sdpa_lens) == [65, 129, 300]
    assert [causal_pairs(ql, n) >= 2000 for ql, n in zip(query_lens, lens, strict=True)].count(True) == 3
    truth = prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, starts, 0.125, HND)
    rows = torch.ones(q.shape[0], dtype=torch.bool)
    rows[starts[1]] = False
    torch.testing.assert_close(got[rows].float(), truth[rows], rtol=2**-7, atol=2**-7)
    # float32, and no threshold: every chunk native.
    sdpa_lens.clear()
    split.prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, starts, 0.125, HND)
    NativeCpuOps(HND).prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.125, HND)
    assert sdpa_lens == []


@pytest.mark.parametrize(
    ("amx", "tiles", "expected"),
    [(True, True, "SDPA_PREFILL_PAIRS_AMX_TILES"), (True, False, "SDPA_PREFILL_PAIRS_AMX"), (False, False, None)],
)
def test_the_sdpa_threshold_is_set_by_where_the_cpu_and_the_kernel_have_amx(
    monkeypatch: pytest.MonkeyPatch, amx: bool, tiles: bool, expected: str | None
) -> None:
    from services.worker.platforms import cpu

    loader.load()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.meshserve_cpu, "prefill_attention_on_amx", lambda: tiles)
    ops = cpu.cpu_ops("native")
    assert isinstance(ops, NativeCpuOps)
    assert ops.sdpa_prefill_pairs == (getattr(cpu, expected) if expected else None)


def test_the_kernel_multiplies_on_amx_tiles_where_it_was_built_for_them() -> None:
    loader.load()
    # A library built for the tiles gets the tile state from Linux (5.16 and later) and runs on them; any
    # other build never does.
    assert torch.ops.meshserve_cpu.prefill_attention_on_amx() is (loader.isa()[0] == "avx512_amx")


def test_prefill_attention_falls_back_where_the_kernel_has_no_layout(native: NativeCpuOps) -> None:
    assert torch.ops.meshserve_cpu.prefill_attention_supported(64, 16)
    assert torch.ops.meshserve_cpu.prefill_attention_supported(128, 32)
    assert not torch.ops.meshserve_cpu.prefill_attention_supported(48, 16)  # not whole vectors
    assert not torch.ops.meshserve_cpu.prefill_attention_supported(64, 4)  # a key chunk would straddle blocks
    # Blocks of 4 tokens: NativeCpuOps takes the reference path and agrees with it.
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_batch([30, 9], [30, 4], 4, 2, 64, HND, torch.float32, 4)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    args = (q, k_cache, v_cache, tables, seq_lens, starts, 0.125)
    torch.testing.assert_close(native.paged_attention(*args), ReferenceOps(HND).paged_attention(*args))
    with pytest.raises(RuntimeError, match="no native prefill attention for head_dim 64 with block_size 4"):
        torch.ops.meshserve_cpu.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.125)


def test_unsupported_head_shapes_take_the_reference_path(native: NativeCpuOps) -> None:
    assert torch.ops.meshserve_cpu.decode_attention_supported(64, 3)
    assert not torch.ops.meshserve_cpu.decode_attention_supported(48, 3)  # not whole vectors
    assert not torch.ops.meshserve_cpu.decode_attention_supported(64, 9)  # group above the unrolled 8
    q, k_cache, v_cache, tables, seq_lens = _paged_batch([5, 20], 9, 1, 64, HND, torch.float32)
    starts = torch.tensor([0, 1, 2])
    args = (q, k_cache, v_cache, tables, seq_lens, starts, 0.125)
    torch.testing.assert_close(native.paged_attention(*args), ReferenceOps(HND).paged_attention(*args))
    with pytest.raises(RuntimeError, match="no native decode attention for head_dim 64 with 9"):
        torch.ops.meshserve_cpu.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
# Row counts around the kernel's block of 4 rows; one scale per row, or per 64 columns (widths of several
# groups, of one, and ones 64 does not divide: one scale per row, with a vector tail). 40 x 2,048 is more x
# than the kernels' retained float32 buffer holds: widened into a tensor of its own.
@pytest.mark.parametrize(
    ("rows", "in_features"), [(1, 576), (3, 576), (4, 100), (9, 1536), (33, 64), (2, 136), (40, 2048)]
)
@pytest.mark.parametrize("group_size", [None, 64, 32])
def test_int8_linear_matches_the_dequantised_reference(
    native: NativeCpuOps, dtype: torch.dtype, rows: int, in_features: int, group_size: int | None
) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = quantize_int8(torch.randn(70, in_features, generator=g) * 0.05, group_size=group_size)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    # Both sum in float32 and round once; only the order of the sums differs. One row of half-precision x on
    # one scale a row rounds x to int16 codes and sums exactly in integers: its oracle rounds x the same way.
    one_row = rows == 1 and weight.scales.shape[1] == 1 and dtype != torch.float32
    expected = int8_rounded_row_reference(x, weight) if one_row else quantized_linear_reference(x, weight)
    _ulp_close(native.int8_linear(x, weight), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_one_row_int8_step_rounds_x_to_16_bits_and_no_further(native: NativeCpuOps, dtype: torch.dtype) -> None:
    # x with an outlier (LLM activations have them) and elements 2^-12 of it: the 16-bit codes keep each
    # output within max|x| * sum|w| / 65534 of the exact product.
    g = torch.Generator().manual_seed(7)
    weight = quantize_int8(torch.randn(40, 1540, generator=g) * 0.05)
    x = torch.randn(1, 1540, generator=g) * 2.0**-12
    x[0, 100] = 3.0
    x = x.to(dtype)
    got = native.int8_linear(x, weight)
    _ulp_close(got, int8_rounded_row_reference(x, weight))
    exact = quantized_linear_reference(x.float(), weight)
    bound = x.float().abs().amax() * weight.dequantize(torch.float32).abs().sum(dim=1) / 65534
    assert bool(((got.float() - exact).abs() <= bound + exact.abs() * 2.0**-7).all())


def test_a_one_row_int8_step_with_inf_or_nan_in_x_propagates_it(native: NativeCpuOps) -> None:
    weight = quantize_int8(torch.randn(8, 64, generator=torch.Generator().manual_seed(2)))
    for bad in (float("inf"), float("nan")):
        x = torch.ones(1, 64, dtype=torch.bfloat16)
        x[0, 5] = bad
        assert not bool(torch.isfinite(native.int8_linear(x, weight)).any()), bad
    zero = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert torch.equal(native.int8_linear(zero, weight), torch.zeros(1, 8, dtype=torch.bfloat16))


def test_a_one_row_int8_step_in_float32_keeps_x_unrounded(native: NativeCpuOps) -> None:
    # x's elements 2^-20 of its largest: 16-bit codes would round them all to 0.
    g = torch.Generator().manual_seed(4)
    weight = quantize_int8(torch.randn(8, 64, generator=g))
    x = torch.randn(1, 64, generator=g) * 2.0**-20
    x[0, 0] = 0.0
    x[0, 1] = 1.0
    weight.qweight[:, 1] = 0
    got = native.int8_linear(x, weight)
    _ulp_close(got, quantized_linear_reference(x, weight))
    assert bool((got != 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
# Rows around the float path's blocks of 4 and the bf16 path's of 8; widths of one block, one pair of blocks,
# an odd block count (the bf16 path's float tail) and SmolLM2's two.
@pytest.mark.parametrize(
    ("rows", "in_features"), [(1, 32), (1, 64), (3, 96), (4, 576), (5, 1536), (8, 96), (9, 576), (17, 64)]
)
def test_int4_linear_matches_the_dequantised_reference(
    native: NativeCpuOps, dtype: torch.dtype, rows: int, in_features: int
) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = quantize_int4(torch.randn(70, in_features, generator=g) * 0.05)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    # Float32 sums rounded once either way (bf16 x on an AVX512-BF16 CPU: exact bf16 products of the codes
    # offset by 128, the offsets added per block); only the order of the sums differs.
    _ulp_close(native.int4_linear(x, weight), quantized_linear_reference(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
# Rows around the widening path's passes of 4 and the bf16 path's of 8; widths of whole vectors (both ISAs,
# and the bf16 path's 32 columns) and ones with a tail (scalar, or the bf16 path's masked loads); 40 x 2,048
# is more x than the kernels' retained float32 buffer holds.
@pytest.mark.parametrize(
    ("rows", "in_features"),
    [(1, 576), (2, 1536), (4, 100), (5, 64), (8, 576), (9, 40), (11, 17), (17, 576), (40, 2048)],
)
def test_half_linear_matches_the_widened_reference(
    native: NativeCpuOps, dtype: torch.dtype, weight_dtype: torch.dtype, rows: int, in_features: int
) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = HalfWeight((torch.randn(70, in_features, generator=g) * 0.05).to(weight_dtype))
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    _ulp_close(native.half_linear(x, weight), quantized_linear_reference(x, weight))


def _half_linear_takes_tiles() -> bool:
    loader.load()
    return bool(torch.ops.meshserve_cpu.half_linear_takes_tiles())


# On AMX tiles where the library and the process have them, else by vdpbf16ps over the same layout.
requires_tiles = pytest.mark.skipif(
    not _half_linear_takes_tiles(),
    reason="half_linear's tile paths need a CPU with AVX512-BF16 (or AMX) and a kernel library built for it",
)


def test_a_tile_packed_half_weight_dequantises_to_the_weight_it_was_packed_from() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    tiled = HalfWeight(tile_half_weight(weight))
    assert tiled.tiled and tiled.in_features == 96 and tiled.nbytes == weight.numel() * 2
    assert torch.equal(tiled.dequantize(torch.bfloat16), weight)
    for shape, dtype in (((40, 96), torch.bfloat16), ((48, 80), torch.bfloat16), ((48, 96), torch.float16)):
        with pytest.raises(ValueError, match="does not fall into bf16 tiles"):
            tile_half_weight(torch.zeros(shape, dtype=dtype))


@requires_tiles
# AMX: one row to a first chunk of two A tiles (16 | 17 rows), 32 rows, and past a chunk (33, 70: x padded to
# chunks of 32); an odd count of 16-row weight tiles (48 and 80 outputs) ends in a pair of one. vdpbf16ps: blocks
# of 8 rows and a remainder, groups of 3 tile columns and a remainder of 1 or 2. 1,536 columns is SmolLM2's down
# projection.
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 96, 576), (3, 48, 64), (16, 80, 96), (17, 96, 576), (32, 64, 1536), (33, 48, 32), (70, 96, 576),
])  # fmt: skip
def test_half_linear_on_tiles_matches_the_widened_reference(
    native: NativeCpuOps, rows: int, out_features: int, in_features: int
) -> None:
    g = torch.Generator().manual_seed(rows)
    dense = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    tiled = NativeCpuOps(HND, half_tiles=True).half_weight(dense)
    assert tiled.tiled
    _ulp_close(native.half_linear(x, tiled), quantized_linear_reference(x, HalfWeight(dense)))


@requires_tiles
def test_half_linear_rows_on_tiles_do_not_depend_on_their_batch() -> None:
    # As on the plain weight: one row alone, 20 rows in one or two A tiles, and 70 rows in padded chunks of 32
    # give every row the same bits.
    g = torch.Generator().manual_seed(3)
    tiles = tile_half_weight(torch.randn(304, 608, generator=g).bfloat16())
    x = (torch.randn(70, 608, generator=g) * 2.0 ** torch.randint(-10, 11, (70, 608), generator=g)).bfloat16()
    half = torch.ops.meshserve_cpu.half_linear
    together = half(x, tiles)
    for r in range(70):
        assert torch.equal(half(x[r : r + 1], tiles), together[r : r + 1])
    for r in range(0, 50, 7):
        assert torch.equal(half(x[r : r + 20], tiles), together[r : r + 20])


def test_the_op_table_packs_half_weights_into_tiles_only_where_its_kernel_multiplies_on_them() -> None:
    weight = torch.randn(48, 64).bfloat16()
    assert not NativeCpuOps(HND).half_weight(weight).tiled
    tiles = NativeCpuOps(HND, half_tiles=True)
    assert tiles.half_weight(weight).tiled
    # A shape or dtype that does not fall into whole tiles stays plain, for the vdpbf16ps or widening path.
    assert not tiles.half_weight(torch.randn(40, 64).bfloat16()).tiled
    assert not tiles.half_weight(torch.randn(48, 64).half()).tiled
    table = cpu_ops("native")
    assert isinstance(table, NativeCpuOps)
    assert table.half_tiles is bool(torch.ops.meshserve_cpu.half_linear_takes_tiles())
    assert torch.ops.meshserve_cpu.half_linear_takes_tiles() is (loader.isa()[0] in loader.BF16_DOT_BUILDS)
    assert torch.ops.meshserve_cpu.half_linear_on_amx() is (loader.isa()[0] == "avx512_amx")


def _int8_linear_takes_tiles() -> bool:
    loader.load()
    return bool(torch.ops.meshserve_cpu.int8_linear_takes_tiles())


requires_int8_tiles = pytest.mark.skipif(
    not _int8_linear_takes_tiles(), reason="int8_linear's tile path needs a kernel library built for AVX-512"
)


def test_a_tile_packed_int8_weight_dequantises_to_the_weight_it_was_packed_from() -> None:
    plain = quantize_int8(torch.randn(48, 96, generator=torch.Generator().manual_seed(1)))
    tiled = tile_int8_weight(plain)
    assert tiled.tiled and tiled.in_features == 96 and tiled.nbytes == plain.nbytes
    assert torch.equal(tiled.dequantize(torch.float32), plain.dequantize(torch.float32))
    for weight in (quantize_int8(torch.randn(40, 96)), quantize_int8(torch.randn(48, 80)),
                   quantize_int8(torch.randn(48, 96), group_size=32)):  # fmt: skip
        with pytest.raises(ValueError, match="does not fall into int8 tiles"):
            tile_int8_weight(weight)


@requires_int8_tiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# One row; blocks of 8 rows and a remainder (3, 9, 17); groups of 3 tile columns and a remainder of 1 or 2 (48, 80,
# 96 outputs); one span of 256 column pairs, two (576: SmolLM2's hidden size) and six (1,536: its down projection);
# 40 x 2,048 is more codes than the kernel's retained buffer holds: a buffer of the call's own.
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 96, 576), (3, 48, 64), (8, 80, 1536), (9, 96, 576), (17, 48, 32), (33, 80, 96), (40, 48, 2048),
])  # fmt: skip
def test_int8_linear_on_tiles_matches_the_rounded_row_reference(
    native: NativeCpuOps, dtype: torch.dtype, rows: int, out_features: int, in_features: int
) -> None:
    # Every row of x rounded to int16 codes, as a one-row step on the plain layout rounds it.
    g = torch.Generator().manual_seed(rows)
    plain = quantize_int8(torch.randn(out_features, in_features, generator=g) * 0.05)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    got = native.int8_linear(x, tile_int8_weight(plain))
    _ulp_close(got, int8_rounded_row_reference(x, plain))
    if rows == 1:
        assert torch.equal(got, native.int8_linear(x, plain))


@requires_int8_tiles
def test_int8_linear_rows_on_tiles_do_not_depend_on_their_batch() -> None:
    g = torch.Generator().manual_seed(3)
    tiled = tile_int8_weight(quantize_int8(torch.randn(304, 608, generator=g)))
    x = (torch.randn(40, 608, generator=g) * 2.0 ** torch.randint(-10, 11, (40, 608), generator=g)).bfloat16()
    int8 = torch.ops.meshserve_cpu.int8_linear
    together = int8(x, tiled.qweight, tiled.scales)
    for r in range(40):
        assert torch.equal(int8(x[r : r + 1], tiled.qweight, tiled.scales), together[r : r + 1])
    for r in range(0, 30, 7):
        assert torch.equal(int8(x[r : r + 11], tiled.qweight, tiled.scales), together[r : r + 11])


@pytest.mark.parametrize("tiles", [False, True])
def test_int8_steps_of_the_largest_codes_do_not_overflow(native: NativeCpuOps, tiles: bool) -> None:
    # Every product at 127 * 32767 and of one sign over ~16,400 columns (Llama-8B's MLP is 14,336 wide): an int32
    # lane summing a whole row would pass 2^31. The plain layout's one-row path widens its sums every 2,048 columns
    # (16,392: a tail past its vectors), the tiles every 256 column pairs (whole tiles: 16,384) for every row.
    if tiles and not _int8_linear_takes_tiles():
        pytest.skip("int8_linear's tile path needs a kernel library built for AVX-512")
    columns = 16384 if tiles else 16392
    g = torch.Generator().manual_seed(9)
    signs = torch.where(torch.rand(16, columns, generator=g) > 0.5, 1.0, -1.0)
    plain = quantize_int8(signs * 0.01)
    assert bool((plain.qweight.abs() == 127).all())
    x = signs[2:5].bfloat16() if tiles else signs[2:3].bfloat16()
    got = native.int8_linear(x, tile_int8_weight(plain) if tiles else plain)
    _ulp_close(got, int8_rounded_row_reference(x, plain))
    assert float(got[0, 2]) == pytest.approx(columns * 0.01, rel=2**-7)


@requires_int8_tiles
def test_a_row_of_inf_or_nan_on_int8_tiles_spoils_only_its_own_outputs(native: NativeCpuOps) -> None:
    g = torch.Generator().manual_seed(2)
    plain = quantize_int8(torch.randn(48, 64, generator=g))
    tiled = tile_int8_weight(plain)
    x = torch.randn(3, 64, generator=g).bfloat16()
    clean = native.int8_linear(x, tiled)
    for bad in (float("inf"), float("nan")):
        poisoned = x.clone()
        poisoned[1, 5] = bad
        got = native.int8_linear(poisoned, tiled)
        assert bool(got[1].isnan().all()), bad
        assert torch.equal(got[[0, 2]], clean[[0, 2]])
    zero = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert torch.equal(native.int8_linear(zero, tiled), torch.zeros(2, 48, dtype=torch.bfloat16))


@requires_int8_tiles
def test_the_int8_tile_kernel_refuses_what_it_cannot_take() -> None:
    tiled = tile_int8_weight(quantize_int8(torch.randn(48, 64)))
    int8 = torch.ops.meshserve_cpu.int8_linear
    with pytest.raises(RuntimeError, match="takes bfloat16 or float16 x"):
        int8(torch.randn(2, 64), tiled.qweight, tiled.scales)
    with pytest.raises(RuntimeError, match="x has 32 features, the tiles 64"):
        int8(torch.randn(2, 32).bfloat16(), tiled.qweight, tiled.scales)
    with pytest.raises(RuntimeError, match=r"float32 scales \[out, 1\]"):
        int8(torch.randn(2, 64).bfloat16(), tiled.qweight, torch.ones(48, 2))


def test_the_op_table_packs_int8_weights_into_tiles_only_for_its_tile_kernel_and_half_activations() -> None:
    plain = quantize_int8(torch.randn(48, 64))
    assert not NativeCpuOps(HND).int8_weight(plain, torch.bfloat16).tiled
    tiles = NativeCpuOps(HND, int8_tiles=True)
    assert tiles.int8_weight(plain, torch.bfloat16).tiled and tiles.int8_weight(plain, torch.float16).tiled
    # float32 activations keep float products; scales per group and shapes off the tiles stay plain.
    assert not tiles.int8_weight(plain, torch.float32).tiled
    assert not tiles.int8_weight(quantize_int8(torch.randn(48, 64), group_size=32), torch.bfloat16).tiled
    assert not tiles.int8_weight(quantize_int8(torch.randn(40, 64)), torch.bfloat16).tiled
    table = cpu_ops("native")
    assert isinstance(table, NativeCpuOps)
    assert table.int8_tiles is bool(torch.ops.meshserve_cpu.int8_linear_takes_tiles())
    assert table.int8_tiles is loader.isa()[0].startswith("avx512")


@pytest.mark.parametrize("fmt", ["int8", "int4", "half"])
def test_bound_kernels_are_the_format_kernels(native: NativeCpuOps, fmt: str) -> None:
    """quantized_kernel binds a weight to exactly the kernel quantized_linear picks for its format."""
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(40, 64, generator=g) * 0.05
    weights: dict[str, QuantizedWeight] = {
        "int8": quantize_int8(dense),
        "int4": quantize_int4(dense),
        "half": HalfWeight(dense.bfloat16()),
    }
    weight = weights[fmt]
    x = torch.randn(3, 64, generator=g).bfloat16()
    assert torch.equal(native.quantized_kernel(weight)(x), native.quantized_linear(x, weight))


def test_half_linear_rows_do_not_depend_on_their_batch(native: NativeCpuOps) -> None:
    # Every row sums in the same order however many rows share its pass: a request's logits are the same
    # in whatever batch it decodes (bf16 x: the widening path, or vdpbf16ps where the CPU has it; 17 rows are
    # passes of 8 and a last one of 1 there, of 4 and 1 on the widening path; 600 columns end in a tail).
    g = torch.Generator().manual_seed(3)
    # Magnitudes over 2^-10..2^10, so sums that cancel show a changed order in the rounded outputs.
    weight = torch.randn(300, 600, generator=g).bfloat16()
    x = (torch.randn(17, 600, generator=g) * 2.0 ** torch.randint(-10, 11, (17, 600), generator=g)).bfloat16()
    together = torch.ops.meshserve_cpu.half_linear(x, weight)
    for r in range(17):
        assert torch.equal(torch.ops.meshserve_cpu.half_linear(x[r : r + 1], weight), together[r : r + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_one_row_outputs_do_not_depend_on_the_weight_rows_beside_them(
    native: NativeCpuOps, dtype: torch.dtype
) -> None:
    # A one-row step multiplies 4 weight rows a pass and the rest one at a time (70 rows over 2 threads: 35
    # each, so passes of 4 and a remainder of 3); every output must come out as it does alone. Columns of
    # mixed magnitudes, so a changed order of the sums shows in the rounded outputs; 600 columns end in a tail.
    g = torch.Generator().manual_seed(11)
    weight = quantize_int8(torch.randn(70, 600, generator=g) * 2.0 ** torch.randint(-8, 9, (70, 600), generator=g))
    x = (torch.randn(1, 600, generator=g) * 2.0 ** torch.randint(-8, 9, (1, 600), generator=g)).to(dtype)
    together = torch.ops.meshserve_cpu.int8_linear(x, weight.qweight, weight.scales)
    for n in range(70):
        alone = torch.ops.meshserve_cpu.int8_linear(x, weight.qweight[n : n + 1], weight.scales[n : n + 1])
        assert torch.equal(alone[0, 0], together[0, n]), n


def test_int4_linear_reads_codes_in_ggufs_nibble_order(native: NativeCpuOps) -> None:
    # One block of one row: byte j holds column j (low nibble) and column j + 16 (high nibble).
    packed = torch.tensor([[(15 - j) << 4 | j for j in range(16)]], dtype=torch.uint8)
    scales, offsets = torch.ones(1, 1), torch.zeros(1, 1)
    for dtype in DTYPES:
        for column, code in ((0, 0), (5, 5), (16, 15), (31, 0)):
            x = torch.zeros(1, 32, dtype=dtype)
            x[0, column] = 1
            assert float(torch.ops.meshserve_cpu.int4_linear(x, packed, scales, offsets)) == code


def test_bad_kernel_inputs_raise_clear_errors(native: NativeCpuOps) -> None:
    q, k_cache, v_cache, tables, seq_lens = _paged_batch([5, 20], 4, 2, 64, HND, torch.float32)
    attend = torch.ops.meshserve_cpu.paged_decode_attention
    with pytest.raises(RuntimeError, match="must share a dtype"):
        attend(q.bfloat16(), k_cache, v_cache, tables, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="does not fit block_tables"):
        attend(q, k_cache, v_cache, tables, torch.tensor([5, 999]), 0.125)
    with pytest.raises(RuntimeError, match="must be int64"):
        attend(q, k_cache, v_cache, tables.int(), seq_lens, 0.125)
    prefill = torch.ops.meshserve_cpu.paged_prefill_attention
    starts = torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="has 2 query tokens but seq_lens 1"):
        prefill(q, k_cache, v_cache, tables, torch.tensor([5, 1]), torch.tensor([0, 0, 2]), 0.125)
    with pytest.raises(RuntimeError, match="must lie within q's 2 tokens"):
        prefill(q, k_cache, v_cache, tables, seq_lens, torch.tensor([0, 1, 3]), 0.125)
    with pytest.raises(RuntimeError, match=r"query_start_loc \[batch \+ 1\] must agree"):
        prefill(q, k_cache, v_cache, tables, seq_lens, starts[:2], 0.125)
    with pytest.raises(RuntimeError, match="does not fit block_tables"):
        prefill(q, k_cache, v_cache, tables, torch.tensor([5, 999]), starts, 0.125)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        torch.ops.meshserve_cpu.rms_norm(
            torch.ones(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-6
        )
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.meshserve_cpu.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6)
    int8 = torch.ops.meshserve_cpu.int8_linear
    with pytest.raises(RuntimeError, match="qweight must be int8"):
        int8(torch.ones(2, 4), torch.ones(3, 4), torch.ones(3))
    with pytest.raises(RuntimeError, match="x has 5 features, qweight 4"):
        int8(torch.ones(2, 5), torch.ones(3, 4, dtype=torch.int8), torch.ones(3))
    with pytest.raises(RuntimeError, match="scales must be float32"):
        int8(torch.ones(2, 4), torch.ones(3, 4, dtype=torch.int8), torch.ones(3, 1, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="3 scale groups do not divide 4 in_features"):
        int8(torch.ones(2, 4), torch.ones(3, 4, dtype=torch.int8), torch.ones(3, 3))
    int4 = torch.ops.meshserve_cpu.int4_linear
    codes = torch.zeros(3, 16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        int4(torch.ones(2, 32), codes.to(torch.int8), torch.ones(3, 1), torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="in_features 48 is not a multiple of 32"):
        int4(torch.ones(2, 48), torch.zeros(3, 24, dtype=torch.uint8), torch.ones(3, 1), torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="x has 64 features, packed 32"):
        int4(torch.ones(2, 64), codes, torch.ones(3, 2), torch.ones(3, 2))
    with pytest.raises(RuntimeError, match=r"scales and offsets must be float32 \[out, in / 32\]"):
        int4(torch.ones(2, 32), codes, torch.ones(3, 1), torch.ones(3, 2))
    with pytest.raises(RuntimeError, match=r"scales and offsets must be float32"):
        int4(torch.ones(2, 32), codes, torch.ones(3, 1), torch.ones(3, 1, dtype=torch.float16))
    half = torch.ops.meshserve_cpu.half_linear
    with pytest.raises(RuntimeError, match="weight must be bfloat16 or float16"):
        half(torch.ones(2, 4), torch.ones(3, 4))
    with pytest.raises(RuntimeError, match="x has 5 features, weight 4"):
        half(torch.ones(2, 5), torch.ones(3, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        half(torch.ones(5), torch.ones(3, 5, dtype=torch.bfloat16))
    tiles = torch.zeros(2, 3, 16, 16, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"x has 64 features, the tiles 96"):
        half(torch.ones(2, 64, dtype=torch.bfloat16), tiles)
    with pytest.raises(RuntimeError, match="a tile-packed weight must be contiguous bfloat16"):
        half(torch.ones(2, 96), tiles)
    with pytest.raises(RuntimeError, match="a tile-packed weight must be contiguous bfloat16"):
        half(torch.ones(2, 96, dtype=torch.bfloat16), torch.zeros(2, 3, 16, 8, 4, dtype=torch.bfloat16))


def test_cpu_ops_choice_and_fallback(monkeypatch: pytest.MonkeyPatch, native: NativeCpuOps) -> None:
    assert isinstance(cpu_ops("auto"), NativeCpuOps)
    assert type(cpu_ops("reference")) is ReferenceOps
    with pytest.raises(ValueError, match="--cpu-kernels must be one of"):
        cpu_ops("fast")

    def broken() -> None:
        raise loader.KernelBuildError("building cpu_ops.cpp, quantized_linear.cpp failed: no compiler")

    monkeypatch.setattr(loader, "load", broken)
    with structlog.testing.capture_logs() as logs:
        assert type(cpu_ops("auto")) is ReferenceOps
    assert logs[0]["event"] == "cpu_kernels_unavailable" and "no compiler" in logs[0]["error"]
    with pytest.raises(DeviceUnavailableError, match="--cpu-kernels reference"):
        CpuPlatform(kernels="native")


def test_a_build_without_a_compiler_fails_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(
        loader.KernelBuildError, match=r"building cpu_ops\.cpp, quantized_linear\.cpp, decode_layers\.cpp failed"
    ):
        loader.build(tmp_path)
    # Nothing half-built is left where a later load would find it.
    assert not loader.library_path(tmp_path).exists()


def test_library_path_is_keyed_by_torch_isa_and_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = loader.library_path(tmp_path)
    assert path.parent.parent == tmp_path
    assert torch.__version__ in path.parent.name and loader.isa()[0] in path.parent.name
    for index, source in enumerate(loader.SOURCES):
        changed = tmp_path / source.name
        changed.write_text(source.read_text() + "\n// changed\n")
        sources = list(loader.SOURCES)
        sources[index] = changed
        monkeypatch.setattr(loader, "SOURCES", tuple(sources))
        assert loader.library_path(tmp_path) != path
        monkeypatch.undo()
    changed = tmp_path / "cpu_common.h"
    changed.write_text(loader.HEADERS[0].read_text() + "\n// changed\n")
    monkeypatch.setattr(loader, "HEADERS", (changed,))
    assert loader.library_path(tmp_path) != path


def _avx512_cpu(monkeypatch: pytest.MonkeyPatch, *, bf16: bool, amx: bool, compiler_takes_amx: bool) -> None:
    """An x86 CPU that torch runs with AVX512, with or without AVX512-BF16 and AMX, and a compiler that does or
    does not take the AMX flags."""
    monkeypatch.setattr(loader.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(loader, "_compiler_accepts", lambda flags: compiler_takes_amx)


@pytest.mark.parametrize(
    ("bf16", "amx", "expected"),
    [(True, True, "avx512_amx"), (True, False, "avx512_bf16"), (False, False, "avx512"), (False, True, "avx512")],
)
def test_an_avx512_cpu_with_bf16_dot_products_or_amx_gets_a_build_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bf16: bool, amx: bool, expected: str
) -> None:
    _avx512_cpu(monkeypatch, bf16=bf16, amx=amx, compiler_takes_amx=True)
    name, flags = loader.isa()
    assert name == expected and ("-mavx512bf16" in flags) is bf16 and "-DCPU_CAPABILITY_AVX512" in flags
    assert ("-mamx-tile" in flags) is (expected == "avx512_amx")
    assert f"-{expected}-" in loader.library_path(tmp_path).parent.name
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert loader.isa()[0] == "avx2"


def test_an_amx_cpu_whose_compiler_knows_no_amx_flags_gets_the_bf16_build(monkeypatch: pytest.MonkeyPatch) -> None:
    _avx512_cpu(monkeypatch, bf16=True, amx=True, compiler_takes_amx=False)
    name, flags = loader.isa()
    assert name == "avx512_bf16" and "-mamx-tile" not in flags and "-mavx512bf16" in flags


def test_the_compiler_probe_tells_known_flags_from_unknown_ones() -> None:
    # The real compiler torch builds with (the kernels above were built by it).
    assert loader._compiler_accepts(("-O2",))
    assert not loader._compiler_accepts(("-mno-such-isa-flag",))


def test_an_unwritable_cache_fails_with_the_variable_to_set(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(loader.KernelBuildError, match=loader.CACHE_DIR_ENV):
        loader.build(blocker / "kernels")


_BUILD_CHECK = """
import sys
from pathlib import Path

import torch

mode, cache = sys.argv[1], Path(sys.argv[2])
if mode == "portable":
    # As on a CPU torch knows no SIMD level for (Kunpeng, say): the kernels build without ISA flags.
    torch.backends.cpu.get_cpu_capability = lambda: "DEFAULT"
else:
    # An AVX512 CPU without AVX512-BF16 (Skylake, Ice Lake): bf16 prefill attention widens to float32.
    torch.cpu._is_avx512_bf16_supported = lambda: False
from services.worker.kernels import loader
from services.worker.layers import norm
from services.worker.layers.attention import HND, decode_attention, prefill_attention
from services.worker.layers.quantization import int8_rounded_row_reference, quantize_int8

assert loader.isa()[0] == mode
torch.ops.load_library(str(loader.build(cache)))
g = torch.Generator().manual_seed(0)
k_cache = torch.randn(8, 2, 16, 64, generator=g)
v_cache = torch.randn(8, 2, 16, 64, generator=g)
q = torch.randn(2, 4, 64, generator=g)
tables = torch.tensor([[3, 1, 0], [5, 0, 0]])
lens = torch.tensor([40, 9])
got = torch.ops.meshserve_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
torch.testing.assert_close(got, decode_attention(q, k_cache, v_cache, tables, lens, 0.125, HND))
starts = torch.tensor([0, 30, 39])
q = torch.randn(39, 4, 64, generator=g)
got = torch.ops.meshserve_cpu.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, 0.125)
torch.testing.assert_close(got, prefill_attention(q, k_cache, v_cache, tables, lens, starts, 0.125, HND))
q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
got = torch.ops.meshserve_cpu.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, 0.125)
truth = prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, starts, 0.125, HND)
torch.testing.assert_close(got.float(), truth, rtol=2**-7, atol=2**-7)
x, w = torch.randn(3, 576, generator=g).bfloat16(), torch.randn(576, generator=g).bfloat16()
torch.testing.assert_close(torch.ops.meshserve_cpu.rms_norm(x, w, 1e-5), norm.rms_norm(x, w, 1e-5), rtol=2**-7, atol=0)
# A one-row int8 step: x rounded to int16 codes, integer sums over two spans and a tail.
w8 = quantize_int8(torch.randn(10, 2100, generator=g) * 0.05)
x8 = torch.randn(1, 2100, generator=g).bfloat16()
got = torch.ops.meshserve_cpu.int8_linear(x8, w8.qweight, w8.scales)
torch.testing.assert_close(got, int8_rounded_row_reference(x8, w8), rtol=2**-7, atol=1e-5)
print(mode, "ok")
"""


def _build_and_check(mode: str, cache: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _BUILD_CHECK, mode, str(cache)],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[3],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{mode} ok" in result.stdout
    assert list(cache.glob(f"*-{mode}-*/meshserve_cpu_ops.so"))


@pytest.mark.slow
def test_the_portable_build_compiles_and_matches_the_reference(tmp_path: Path) -> None:
    """The build non-x86 hosts get (no ISA flags, at::vec's generic vectors), in a fresh process."""
    _build_and_check("portable", tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX512 CPU")
def test_the_avx512_build_without_bf16_dot_products_matches_the_reference(tmp_path: Path) -> None:
    """Where the CPU has AVX512 but not AVX512-BF16, bf16 prefill attention takes the float32 operands."""
    _build_and_check("avx512", tmp_path)


@pytest.mark.parametrize("layout", [HND, NHD])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_matches_the_reference_from_strided_views(
    native: NativeCpuOps, layout: str, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(5)
    # k and v as the model has them: head-split slices of one fused QKV row, not contiguous.
    qkv = torch.randn(7, (4 + 2 + 2) * 64, generator=g).to(dtype)
    _, k, v = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    k, v = k.reshape(7, 2, 64), v.reshape(7, 2, 64)
    assert not k.is_contiguous()
    slots = torch.tensor([0, 17, 18, 31, 5, 40, 63])
    caches = {}
    for ops in (NativeCpuOps(layout), ReferenceOps(layout)):
        k_cache = torch.zeros(cache_shape(4, 16, 2, 64, layout), dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
        caches[type(ops).__name__] = (k_cache, v_cache)
    for native_cache, reference_cache in zip(caches["NativeCpuOps"], caches["ReferenceOps"], strict=True):
        assert torch.equal(native_cache, reference_cache)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 64 is outside the cache's 64 slots"):
        torch.ops.meshserve_cpu.reshape_and_cache(
            k, v, head_major(k_cache, layout), head_major(v_cache, layout), torch.tensor([64, 0, 0, 0, 0, 0, 0])
        )
