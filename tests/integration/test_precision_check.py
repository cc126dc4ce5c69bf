"""bf16-fp16-fp32 against fp32 on SmolLM2: relative logit error within budget, greedy agreement reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.benchmarks.precision_check import chat_prompts, compare, main

pytestmark = pytest.mark.slow
# The budget for the Ascend seed precision.
MAX_MEAN_RELATIVE_LOGIT_ERROR = 0.008


def test_bf16_fp16_fp32_logits_stay_close_to_fp32(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = compare(smollm2_dir, "bf16-fp16-fp32", chat_prompts(smollm2_dir, 8), new_tokens=16)
    with capsys.disabled():
        print(
            f"\nbf16-fp16-fp32 vs fp32: mean relative logit error {report.mean_relative_logit_error:.4%}, "
            f"greedy exact matches {report.greedy_exact_matches}/{report.prompts}, "
            f"common prefixes {report.greedy_common_prefix}"
        )
    assert report.precision == "bf16-fp16-fp32"
    assert report.mean_relative_logit_error <= MAX_MEAN_RELATIVE_LOGIT_ERROR
    assert 0 <= report.greedy_exact_matches <= report.prompts == 8


def test_fp32_against_itself_is_exact(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert main(["--precision", "fp32-fp32-fp32", "--model", str(smollm2_dir), "--prompts", "2",
                 "--new-tokens", "4", "--out", str(out)]) == 0  # fmt: skip
    text = out.read_text()
    assert '"mean_relative_logit_error": 0.0' in text and '"greedy_exact_matches": 2' in text


# Weight-only int8 on top of bf16 (measured 4.9% over 16 prompts and 32 tokens; bf16 alone 1.4%).
MAX_INT8_MEAN_RELATIVE_LOGIT_ERROR = 0.07


def test_int8_weights_stay_within_their_budget(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = compare(smollm2_dir, "bf16-bf16-fp32", chat_prompts(smollm2_dir, 4), new_tokens=16, quantization="int8")
    with capsys.disabled():
        print(f"\nint8 + bf16-bf16-fp32 vs fp32: mean relative logit error {report.mean_relative_logit_error:.4%}")
    assert report.quantization == "int8"
    # Above bf16's own error (the rounding happened) and within the budget.
    assert 0.014 < report.mean_relative_logit_error <= MAX_INT8_MEAN_RELATIVE_LOGIT_ERROR


def test_the_gguf_blocks_are_the_embedded_models_weights(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The embedded directory is its GGUF dequantised: in fp32 the file's blocks give the same model (only the
    order of float sums differs), and in bf16 no more error than bf16 itself (1.4%)."""
    from services.worker.model_fetch import ensure_embedded_gguf

    gguf = ensure_embedded_gguf()
    prompts = chat_prompts(smollm2_dir, 4)
    exact = compare(smollm2_dir, "fp32-fp32-fp32", prompts, 16, quantization="gguf", tested_model=gguf)
    half = compare(smollm2_dir, "bf16-bf16-fp32", prompts, 16, quantization="gguf", tested_model=gguf)
    with capsys.disabled():
        print(
            f"\ngguf blocks vs fp32: {exact.mean_relative_logit_error:.2e} in fp32, "
            f"{half.mean_relative_logit_error:.4%} in bf16-bf16-fp32"
        )
    assert exact.mean_relative_logit_error < 1e-4 and exact.greedy_exact_matches == exact.prompts
    assert half.mean_relative_logit_error <= MAX_MEAN_RELATIVE_LOGIT_ERROR * 3
