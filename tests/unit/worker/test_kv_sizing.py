"""KV budget arithmetic and the startup errors that name the flag to change."""

from __future__ import annotations

import pytest

from services.worker.kv_sizing import (
    DeviceMemory,
    blocks_for_budget,
    check_fits_one_sequence,
    device_kv_budget,
)
from services.worker.memory_profile import profile_spans
from services.worker.startup_error import StartupError

GIB = 1 << 30


def test_device_budget_is_utilization_minus_weights_and_peak() -> None:
    memory = DeviceMemory(total_bytes=64 * GIB, free_at_start_bytes=63 * GIB, weights_bytes=14 * GIB,
                          activation_peak_bytes=2 * GIB)  # fmt: skip
    assert device_kv_budget(memory, 0.9) == int(64 * GIB * 0.9) - 16 * GIB


def test_device_shared_with_others_says_lower_utilization() -> None:
    memory = DeviceMemory(total_bytes=64 * GIB, free_at_start_bytes=32 * GIB, weights_bytes=GIB,
                          activation_peak_bytes=GIB)  # fmt: skip
    with pytest.raises(StartupError) as info:
        device_kv_budget(memory, 0.9)
    text = str(info.value)
    assert "out of device memory" in text and "lower --gpu-memory-utilization to 0.49 or less" in text


def test_no_room_after_weights_names_the_flags() -> None:
    memory = DeviceMemory(total_bytes=16 * GIB, free_at_start_bytes=16 * GIB, weights_bytes=14 * GIB,
                          activation_peak_bytes=GIB)  # fmt: skip
    with pytest.raises(StartupError, match="lower --max-num-batched-tokens or --max-num-seqs"):
        device_kv_budget(memory, 0.9)


def test_blocks_for_budget_rounds_down() -> None:
    assert blocks_for_budget(10 * 4096 + 5, 4096) == 10
    assert blocks_for_budget(-1, 4096) == 0


@pytest.mark.parametrize(("device", "budget_flag"), [("cpu", "--kv-cache-memory"), ("npu", "--gpu-memory-utilization")])
def test_cache_too_small_for_one_sequence(device: str, budget_flag: str) -> None:
    check_fits_one_sequence(7, block_size=16, max_model_len=100, bytes_per_block=64, device=device)
    with pytest.raises(StartupError) as info:
        check_fits_one_sequence(6, block_size=16, max_model_len=100, bytes_per_block=64, device=device)
    text = str(info.value)
    assert "one --max-model-len=100 sequence needs 7" in text
    assert "lower --max-model-len, --max-num-seqs or --max-num-batched-tokens" in text
    assert f"raise {budget_flag}" in text


def test_profile_spans_cover_the_token_budget() -> None:
    assert profile_spans(2048, 8192, 64) == [2048]
    assert profile_spans(2048, 512, 64) == [512, 512, 512, 512]
    assert profile_spans(100, 30, 2) == [30, 30]
