"""CpuPlatform's matmul backend choice: oneDNN off for one-row matmuls only, and always restored."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("supported", [True, False])
def test_bf16_weights_are_packed_only_where_onednn_runs_bf16(
    monkeypatch: pytest.MonkeyPatch, supported: bool
) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: supported)
    assert CpuPlatform().packs_weights(torch.bfloat16) is supported
    assert not CpuPlatform(kernels="reference").packs_weights(torch.bfloat16)
    assert not CpuPlatform().packs_weights(torch.float32)
