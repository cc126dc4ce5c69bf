"""Weight-only quantisation (int8, a GGUF's own blocks): the rounding, the linears' choice of path by rows, and
the runner's startup rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

from services.worker.engine_config import EngineConfig
from services.worker.layers.linear import (
    ColumnParallelLinear,
    Shard,
    attach_quantized,
    pack_linears,
    quantize_matmuls,
    release_quantized_weights,
)
from services.worker.layers.quantization import (
    INT8_LEVELS,
    Int4Weight,
    Int8Weight,
    binder_of,
    quantize_int4,
    quantize_int8,
    quantized_linear_reference,
)
from services.worker.model_runner import ModelRunner
from services.worker.platforms.cpu_native_ops import NativeCpuOps
from services.worker.startup_error import StartupError
from tests.support.tiny_gguf import make_tiny_gguf


def test_groups_round_to_within_half_a_step_of_their_scale() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=g)
    weight[3, :64] = 0.0
    weight[5, 70] = 40.0  # an outlier costs only its own group precision
    q = quantize_int8(weight, group_size=64)
    assert q.qweight.dtype == torch.int8 and q.scales.dtype == torch.float32
    assert q.scales.shape == (64, 2)
    assert int(q.qweight.abs().max()) == INT8_LEVELS
    assert q.scales[3, 0] == 1.0 and not q.qweight[3, :64].any()
    error = (q.dequantize(torch.float32) - weight).abs().view(64, 2, 64)
    assert torch.all(error <= q.scales[:, :, None] / 2 + 1e-6)
    assert q.scales[5, 0] < q.scales[5, 1] / 10
    assert q.nbytes == 64 * 128 + 64 * 2 * 4
    # By default, and for a width the group size does not divide: one scale per row.
    assert quantize_int8(weight).scales.shape == (64, 1)
    assert quantize_int8(torch.randn(4, 100, generator=g), group_size=64).scales.shape == (4, 1)


def _linear(weight: torch.Tensor) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(weight.shape[1], [Shard(0, weight.shape[0])], False, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def test_small_steps_take_the_int8_kernel_and_large_ones_the_packed_gemm() -> None:
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(48, 32, generator=g) * 0.1).to(torch.bfloat16)
    calls: list[int] = []

    def op(x: torch.Tensor, w: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return quantized_linear_reference(x, w)  # type: ignore[arg-type]

    layer = _linear(weight)
    quantize_matmuls([layer], binder_of(op), lambda weight: 4)
    pack_linears([layer], torch.bfloat16, torch.float32, 4)
    release_quantized_weights([layer], torch.bfloat16)
    assert layer.weight.numel() == 0  # only the int8 and the packed copies remain
    small, large = torch.randn(4, 32, generator=g).bfloat16(), torch.randn(9, 32, generator=g).bfloat16()
    torch.testing.assert_close(layer(small), quantized_linear_reference(small, layer.quantized.weight))  # type: ignore[union-attr]
    assert calls == [4]
    # Past max_rows: the packed GEMM, on the int8 weight dequantised (the same model at every step size).
    expected = large.float() @ layer.quantized.weight.dequantize(torch.bfloat16).float().T  # type: ignore[union-attr]
    torch.testing.assert_close(layer(large).float(), expected, rtol=2**-7, atol=1e-3)
    assert calls == [4]


def test_without_a_packed_copy_large_steps_dequantise() -> None:
    weight = torch.randn(16, 8).to(torch.bfloat16)
    layer = _linear(weight)
    quantize_matmuls([layer], binder_of(quantized_linear_reference), lambda weight: 1)
    release_quantized_weights([layer], torch.bfloat16)
    x = torch.randn(5, 8).bfloat16()
    expected = torch.nn.functional.linear(x, layer.quantized.weight.dequantize(torch.bfloat16))  # type: ignore[union-attr]
    torch.testing.assert_close(layer(x), expected)


def test_max_rows_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        quantize_matmuls([_linear(torch.ones(2, 2))], binder_of(quantized_linear_reference), lambda weight: 0)


def _config(model_dir: Path, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = {
        "model_path": str(model_dir),
        "precision": "bf16-bf16-fp32",
        "device": "cpu",
        "kv_cache_memory_bytes": 16 << 20,
        "max_model_len": 128,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 4,
        **overrides,
    }
    return EngineConfig(**fields)  # type: ignore[arg-type]


def test_the_flag_is_checked_and_refused_without_an_int8_kernel(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--quantization must be one of \\['int8', 'gguf'\\]"):
        _config(tiny_model_dir, quantization="fp4")
    with pytest.raises(StartupError, match="--quantization int8 has no quantised kernels on cpu"):
        ModelRunner(_config(tiny_model_dir, quantization="int8", cpu_kernels="reference"))


def test_an_int8_runner_stays_close_to_its_bf16_twin(tiny_model_dir: Path) -> None:
    plain = ModelRunner(_config(tiny_model_dir))
    quantized = ModelRunner(_config(tiny_model_dir, quantization="int8"))
    # The tiny model's shapes fall into whole tiles: packed where the op table's int8 kernel takes tiles.
    ops = quantized.platform.ops
    tiles = isinstance(ops, NativeCpuOps) and ops.int8_tiles
    assert quantized.matmul_weights.startswith("int8-tiles+" if tiles else "int8+")
    plain_bytes, quantized_bytes = plain.rank_memory[0].weights_bytes, quantized.rank_memory[0].weights_bytes
    if plain.matmul_weights == "onednn-bfloat16":
        # oneDNN runs bf16 natively (AMX): the int8 copy (one-row steps) sits beside the packed bf16 one.
        assert plain_bytes < quantized_bytes < 2 * plain_bytes
    else:
        # Packed in fp32 beside the bf16 weight for one-row steps (6 bytes a weight) vs int8 + fp32 (5).
        assert quantized_bytes < plain_bytes
    prompt = list(range(3, 40))
    blocks = list(range(-(-len(prompt) // plain.block_size) + 1))
    # One prefill (past max_rows: the packed GEMM) then one-row decodes (the int8 kernel).
    spans = [(prompt, blocks, 0, len(prompt))]
    ref = plain.forward(spans, [len(prompt) - 1])
    got = quantized.forward(spans, [len(prompt) - 1])
    assert ref is not None and got is not None
    for step in range(3):
        tokens = [*prompt, *range(50, 50 + step + 1)]
        decode = [(tokens, blocks, len(tokens) - 1, 1)]
        ref_row, got_row = plain.forward(decode, [0]), quantized.forward(decode, [0])
        assert ref_row is not None and got_row is not None
        relative = float((got_row - ref_row).norm() / ref_row.norm())
        # A random tiny model's logits are small and close together: a loose bound here; SmolLM2's real
        # figure is test_precision_check's.
        assert 0 < relative < 0.1, relative
    plain.close()
    quantized.close()


def test_the_quantised_threshold_follows_the_gemm_it_replaces() -> None:
    from services.worker.platforms import cpu

    native = cpu.CpuPlatform(kernels="native")
    # fp32 matmuls run on MKL: the kernels win up to 8 rows.
    assert native.matmul_gemm(torch.float32) == cpu.MKL_FP32
    assert native.quantized_max_rows(torch.float32) == 8
    # bf16 runs in oneDNN's own bf16 GEMM where the CPU has one (AMX, avx512_bf16), which the quantised
    # kernels beat up to 4 rows; elsewhere on fp32 copies, like fp32.
    bf16_native = native.matmul_pack_dtype(torch.bfloat16) == torch.bfloat16
    assert native.matmul_gemm(torch.bfloat16) in (
        (cpu.ONEDNN_HALF, cpu.ONEDNN_HALF_AMX) if bf16_native else (cpu.ONEDNN_FP32_COPIES,)
    )
    assert native.quantized_max_rows(torch.bfloat16) == (4 if bf16_native else 8)
    # int8 weights in tiles: their kernel beats the plain one, oneDNN's AMX GEMM up to 16 rows and its
    # avx512_bf16 GEMM up to 8; against any other GEMM they take the plain kernel's rows.
    tiled_rows = {cpu.ONEDNN_HALF_AMX: 16, cpu.ONEDNN_HALF: 8}
    plain = native.quantized_max_rows(torch.bfloat16)
    expected = tiled_rows.get(native.matmul_gemm(torch.bfloat16), plain)
    assert native.quantized_max_rows(torch.bfloat16, tiled=True) == expected
    assert cpu.CpuPlatform(kernels="reference").quantized_max_rows(torch.bfloat16) == 0


def test_the_gemm_class_names_amx_only_where_the_cpu_has_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.platforms import cpu

    native = cpu.CpuPlatform(kernels="native")
    monkeypatch.setattr(native, "matmul_pack_dtype", lambda dtype: dtype)
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert native.matmul_gemm(torch.bfloat16) == (cpu.ONEDNN_HALF_AMX if amx else cpu.ONEDNN_HALF)
        assert native.matmul_gemm(torch.float16) == cpu.ONEDNN_HALF
    monkeypatch.setattr(native, "matmul_pack_dtype", lambda dtype: torch.float32)
    assert native.matmul_gemm(torch.bfloat16) == cpu.ONEDNN_FP32_COPIES
    monkeypatch.setattr(native, "matmul_pack_dtype", lambda dtype: None)
    assert native.matmul_gemm(torch.bfloat16) == cpu.ATEN_HALF
    assert native.quantized_max_rows(torch.bfloat16) == 8 and native.half_max_rows(torch.bfloat16) == 0


def test_half_weights_take_small_steps_where_the_gemm_would_widen_them_or_read_few_rows_slowly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.worker.platforms import cpu

    native = cpu.CpuPlatform(kernels="native")
    assert native.half_max_rows(torch.float32) == 0
    for dtype in (torch.bfloat16, torch.float16):
        assert cpu.CpuPlatform(kernels="reference").half_max_rows(dtype) == 0
    # Where the packed GEMM widens, the kernel reads half the bytes up to 16 rows.
    monkeypatch.setattr(native, "matmul_pack_dtype", lambda dtype: torch.float32)
    assert native.half_max_rows(torch.bfloat16) == native.half_max_rows(torch.float16) == 16
    # A native bf16 GEMM: the vdpbf16ps path for the smallest steps, one row against oneDNN's AMX GEMM; weights
    # packed into tiles up to 128 rows there and up to 512 against oneDNN's avx512_bf16 GEMM; fp16 has no such
    # path (its widening one would lose to a native fp16 GEMM). Both builds with vdpbf16ps count, the AMX one too.
    monkeypatch.setattr(native, "matmul_pack_dtype", lambda dtype: dtype)
    for build in ("avx512_bf16", "avx512_amx"):
        monkeypatch.setattr(cpu.loader, "isa", lambda build=build: (build, []))
        for amx, rows, tiled_rows in ((True, 1, 128), (False, 4, 512)):
            monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
            assert native.half_max_rows(torch.bfloat16) == rows
            assert native.half_max_rows(torch.bfloat16, tiled=True) == tiled_rows
            assert native.half_max_rows(torch.float16) == 0
    # A kernel library built without the instructions has only the widening path there.
    monkeypatch.setattr(cpu.loader, "isa", lambda: ("avx512", []))
    assert native.half_max_rows(torch.bfloat16) == 0


def test_int4_blocks_round_to_within_half_a_step_of_their_scale() -> None:
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(8, 96, generator=g)
    weight[1, :32] = 0.5  # a constant block: scale 1, every code 0, the offset the value
    q = quantize_int4(weight)
    assert q.packed.shape == (8, 48) and q.packed.dtype == torch.uint8
    assert q.scales.shape == q.offsets.shape == (8, 3)
    assert q.nbytes == 8 * 48 + 2 * 8 * 3 * 4
    error = (q.dequantize(torch.float32) - weight).abs().view(8, 3, 32)
    assert torch.all(error <= q.scales[:, :, None] / 2 + 1e-6)
    assert torch.equal(q.dequantize(torch.float32)[1, :32], torch.full((32,), 0.5))
    # Codes in column order: the low nibbles first, then the high ones, block by block.
    codes = q.codes()
    assert torch.equal(codes[:, :16], q.packed[:, :16] & 0x0F) and torch.equal(codes[:, 16:32], q.packed[:, :16] >> 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.ones(2, 48))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # An F16 up projection: its fused gate_up linear has no kernel for both parts and stays dense.
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf", formats={"ffn_up": "F16"})


def test_gguf_needs_a_gguf_model_and_a_kernel(tiny_model_dir: Path, tiny_gguf: Path) -> None:
    with pytest.raises(ValueError, match=r"--quantization gguf serves a \.gguf file's quantised blocks"):
        _config(tiny_model_dir, quantization="gguf")
    with pytest.raises(StartupError, match="--quantization gguf has no quantised kernels on cpu"):
        ModelRunner(_config(tiny_gguf, quantization="gguf", cpu_kernels="reference"))


@pytest.mark.parametrize("precision", ["fp32-fp32-fp32", "bf16-bf16-fp32"])
def test_a_gguf_runner_multiplies_the_files_blocks_and_matches_its_dequantised_twin(
    tiny_gguf: Path, precision: str
) -> None:
    plain = ModelRunner(_config(tiny_gguf, precision=precision))
    quantized = ModelRunner(_config(tiny_gguf, precision=precision, quantization="gguf"))
    assert quantized.matmul_weights.startswith("gguf+")
    layers = quantized.model.model.layers
    # q/k/v (Q4_1, Q4_1, Q4_0: one 4-bit format), o (Q8_0) and down (Q4_0) take the file's blocks; gate_up
    # (Q4_1 beside F16) stays dense, and so does nothing else.
    for layer in layers.values():
        attention, mlp = cast(Any, layer.self_attn), cast(Any, layer.mlp)
        assert isinstance(attention.qkv_proj.quantized.weight, Int4Weight)
        assert isinstance(attention.o_proj.quantized.weight, Int8Weight)
        assert isinstance(mlp.down_proj.quantized.weight, Int4Weight)
        assert mlp.gate_up_proj.quantized is None
    assert isinstance(quantized.model.head().quantized.weight, Int8Weight)  # type: ignore[union-attr]
    prompt = list(range(3, 40))
    blocks = list(range(-(-len(prompt) // plain.block_size) + 1))
    spans = [(prompt, blocks, 0, len(prompt))]
    assert plain.forward(spans, [len(prompt) - 1]) is not None
    assert quantized.forward(spans, [len(prompt) - 1]) is not None
    for step in range(3):
        tokens = [*prompt, *range(50, 50 + step + 1)]
        decode = [(tokens, blocks, len(tokens) - 1, 1)]
        ref_row, got_row = plain.forward(decode, [0]), quantized.forward(decode, [0])
        assert ref_row is not None and got_row is not None
        # The same weights exactly (the blocks dequantise to what transformers loads): only the order of the
        # float32 sums differs, and bf16 rounds the inputs of every matmul either way.
        tolerance = 1e-4 if precision.startswith("fp32") else 0.05
        relative = float((got_row - ref_row).norm() / ref_row.norm())
        assert relative < tolerance, relative
    plain.close()
    quantized.close()


def test_blocks_that_do_not_match_the_dense_weight_fail_at_load() -> None:
    layer = _linear(torch.randn(8, 64).to(torch.bfloat16))
    wrong = quantize_int4(torch.randn(8, 64))
    layer.load_quantized(wrong, 0)
    with pytest.raises(ValueError, match="do not dequantise to its weight"):
        attach_quantized([layer], binder_of(quantized_linear_reference), max_rows=1)


def test_a_row_parallel_shard_off_the_blocks_is_refused() -> None:
    from services.worker.distributed import SINGLE
    from services.worker.layers.linear import RowParallelLinear

    weight = quantize_int4(torch.randn(4, 128))
    aligned = RowParallelLinear(Shard(64, 64), 4, False, torch.float32, SINGLE)
    aligned.load_quantized(weight, 0)
    shard = aligned.checkpoint_quantized()
    assert shard is not None and torch.equal(shard.dequantize(torch.float32), weight.dequantize(torch.float32)[:, 64:])
    with pytest.raises(ValueError, match="do not fall on its blocks of 32 columns"):
        RowParallelLinear(Shard(48, 80), 4, False, torch.float32, SINGLE).load_quantized(weight, 0)
