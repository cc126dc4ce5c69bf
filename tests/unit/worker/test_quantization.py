"""Weight-only int8: the rounding, the linears' choice of path by rows, and the runner's startup rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine_config import EngineConfig
from services.worker.layers.linear import (
    ColumnParallelLinear,
    Shard,
    pack_linears,
    quantize_matmuls,
    release_quantized_weights,
)
from services.worker.layers.quantization import INT8_LEVELS, int8_linear_reference, quantize_int8
from services.worker.model_runner import ModelRunner
from services.worker.startup_error import StartupError


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
        return int8_linear_reference(x, w)  # type: ignore[arg-type]

    layer = _linear(weight)
    quantize_matmuls([layer], op, max_rows=4)
    pack_linears([layer], torch.bfloat16, torch.float32, 4)
    release_quantized_weights([layer], torch.bfloat16)
    assert layer.weight.numel() == 0  # only the int8 and the packed copies remain
    small, large = torch.randn(4, 32, generator=g).bfloat16(), torch.randn(9, 32, generator=g).bfloat16()
    torch.testing.assert_close(layer(small), int8_linear_reference(small, layer.quantized.weight))  # type: ignore[union-attr]
    assert calls == [4]
    # Past max_rows: the packed GEMM, on the int8 weight dequantised (the same model at every step size).
    expected = large.float() @ layer.quantized.weight.dequantize(torch.bfloat16).float().T  # type: ignore[union-attr]
    torch.testing.assert_close(layer(large).float(), expected, rtol=2**-7, atol=1e-3)
    assert calls == [4]


def test_without_a_packed_copy_large_steps_dequantise() -> None:
    weight = torch.randn(16, 8).to(torch.bfloat16)
    layer = _linear(weight)
    quantize_matmuls([layer], int8_linear_reference, max_rows=1)
    release_quantized_weights([layer], torch.bfloat16)
    x = torch.randn(5, 8).bfloat16()
    expected = torch.nn.functional.linear(x, layer.quantized.weight.dequantize(torch.bfloat16))  # type: ignore[union-attr]
    torch.testing.assert_close(layer(x), expected)


def test_max_rows_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        quantize_matmuls([_linear(torch.ones(2, 2))], int8_linear_reference, max_rows=0)


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
    with pytest.raises(ValueError, match="--quantization must be one of \\['int8'\\]"):
        _config(tiny_model_dir, quantization="fp4")
    with pytest.raises(StartupError, match="--quantization int8 has no int8 kernel on cpu"):
        ModelRunner(_config(tiny_model_dir, quantization="int8", cpu_kernels="reference"))


def test_an_int8_runner_stays_close_to_its_bf16_twin(tiny_model_dir: Path) -> None:
    plain = ModelRunner(_config(tiny_model_dir))
    quantized = ModelRunner(_config(tiny_model_dir, quantization="int8"))
    assert quantized.matmul_weights.startswith("int8+")
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


def test_the_int8_threshold_follows_the_gemm_it_replaces() -> None:
    from services.worker.platforms import cpu

    native = cpu.CpuPlatform(kernels="native")
    # fp32 matmuls run on MKL (or on fp32 copies in oneDNN): the int8 kernel wins up to INT8_MAX_ROWS rows.
    assert native.int8_max_rows(torch.float32) == cpu.INT8_MAX_ROWS
    # bf16 runs in oneDNN's own bf16 GEMM where the CPU has one (AMX, avx512_bf16), which matches the int8
    # kernel from two rows up; elsewhere on fp32 copies, like fp32.
    bf16_native = native.matmul_pack_dtype(torch.bfloat16) == torch.bfloat16
    expected = cpu.INT8_MAX_ROWS_NATIVE_HALF if bf16_native else cpu.INT8_MAX_ROWS
    assert native.int8_max_rows(torch.bfloat16) == expected
    assert cpu.CpuPlatform(kernels="reference").int8_max_rows(torch.bfloat16) == 0
