"""CpuPlatform's matmul choices: oneDNN off for one-row unpacked matmuls, and the dtype weights are packed in."""

from __future__ import annotations

import pytest
import torch

from services.worker.layers.linear import ColumnParallelLinear, Shard, pack_linears
from services.worker.platforms.cpu import CpuPlatform


def test_one_row_matmuls_run_without_onednn_and_the_flag_comes_back() -> None:
    platform = CpuPlatform()
    assert torch.backends.mkldnn.enabled
    with platform.matmul_backend(1):
        assert not torch.backends.mkldnn.enabled
    assert torch.backends.mkldnn.enabled
    with platform.matmul_backend(2):
        assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError), platform.matmul_backend(1):
        raise RuntimeError("a failed step")
    assert torch.backends.mkldnn.enabled


def test_one_row_bf16_matmul_agrees_with_onednn() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    w = torch.randn(960, 576, dtype=torch.bfloat16)
    reference = torch.nn.functional.linear(x.float(), w.float())
    with CpuPlatform().matmul_backend(1):
        aten = torch.nn.functional.linear(x, w).float()
    onednn = torch.nn.functional.linear(x, w).float()
    # Both accumulate in fp32 and round once to bf16: within bf16's half-ulp of the fp32 result.
    for out in (aten, onednn):
        torch.testing.assert_close(out, reference, rtol=2**-8, atol=1e-2)


@pytest.mark.parametrize(
    ("dtype", "probe"), [(torch.bfloat16, "_is_mkldnn_bf16_supported"), (torch.float16, "_is_mkldnn_fp16_supported")]
)
@pytest.mark.parametrize("supported", [True, False])
def test_half_weights_pack_in_their_dtype_where_onednn_runs_it_else_in_fp32(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, probe: str, supported: bool
) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, probe, lambda: supported)
    assert CpuPlatform().matmul_pack_dtype(dtype) == (dtype if supported else torch.float32)
    assert CpuPlatform(kernels="reference").matmul_pack_dtype(dtype) is None
    assert CpuPlatform().matmul_pack_dtype(torch.float32) is None


@pytest.mark.parametrize("pack_dtype", [torch.float32, torch.bfloat16])
def test_a_bf16_linear_on_packed_weights_is_the_exact_product_rounded_once(pack_dtype: torch.dtype) -> None:
    # Widening bf16 is exact, so packed in fp32 the result differs from the true product only by fp32
    # accumulation order and one rounding to bf16 at the end, as a native bf16 GEMM's does.
    if pack_dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no native bf16 on this host")
    torch.manual_seed(0)
    x = torch.randn(7, 96).bfloat16()
    weight = torch.randn(40, 96).bfloat16()
    bias = torch.randn(40).bfloat16()
    layer = ColumnParallelLinear(96, [Shard(0, 40)], bias=True, compute_dtype=torch.bfloat16).bfloat16()
    layer.load("weight", weight, 0)
    layer.load("bias", bias, 0)
    pack_linears([layer], torch.bfloat16, pack_dtype, batch_hint=8)
    assert layer.packed is not None and layer.packed.dtype == pack_dtype
    got = layer(x)
    assert got.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T + bias.double()
    # Within one bf16 ulp of the exact value.
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


def test_one_row_matmuls_read_the_plain_bf16_weight_that_fp32_packing_keeps() -> None:
    torch.manual_seed(1)
    weight = torch.randn(64, 32).bfloat16()
    layer = ColumnParallelLinear(32, [Shard(0, 64)], bias=False, compute_dtype=torch.bfloat16).bfloat16()
    layer.load("weight", weight, 0)
    pack_linears([layer], torch.bfloat16, torch.float32, batch_hint=8)
    assert torch.equal(layer.weight, weight)
    x = torch.randn(1, 32).bfloat16()
    packed_out = layer(x)
    with CpuPlatform().matmul_backend(1):
        one_row = layer(x)
        assert torch.equal(one_row, torch.nn.functional.linear(x, weight))
    # Both paths are the same product to within a bf16 rounding.
    torch.testing.assert_close(one_row, packed_out, rtol=2**-7, atol=1e-5)
