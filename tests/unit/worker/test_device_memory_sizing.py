"""KV sizing on a device: the profile run's peak, --gpu-memory-utilization, and out-of-memory startup errors.

A fake "device" platform runs on the CPU but reports device-style memory numbers, so the sizing code
that only runs on CUDA / NPU is exercised here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine_config import EngineConfig
from services.worker.kv_cache import bytes_per_block
from services.worker.model_runner import ModelRunner
from services.worker.platforms.base import MemoryInfo
from services.worker.platforms.cpu import CpuPlatform
from services.worker.startup_error import StartupError
from tests.support.tiny_model import make_tiny_model

GIB = 1 << 30


class FakeDevicePlatform(CpuPlatform):
    """A CPU that claims to be an accelerator with `total` bytes, `used_by_others` of them taken."""

    name = "fakedev"

    def __init__(self, total: int, used_by_others: int, activation_peak: int, oom_on_forward: bool = False) -> None:
        super().__init__(0)
        self.total = total
        self.used_by_others = used_by_others
        self.activation_peak = activation_peak
        self.oom_on_forward = oom_on_forward
        self.peak_resets = 0
        self._peak_reads = 0

    def memory_info(self) -> MemoryInfo:
        return MemoryInfo(free_bytes=self.total - self.used_by_others, total_bytes=self.total)

    def reset_peak_memory(self) -> None:
        self.peak_resets += 1
        self._peak_reads = 0
        if self.oom_on_forward:
            raise torch.OutOfMemoryError("Tried to allocate 20.00 GiB")

    def peak_memory_bytes(self) -> int:
        # The profile run reads the peak once before its forward (baseline) and once after.
        self._peak_reads += 1
        return 0 if self._peak_reads == 1 else self.activation_peak


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _runner(model_dir: Path, platform: FakeDevicePlatform, **kw: object) -> ModelRunner:
    args: dict[str, object] = {"model_path": str(model_dir), "max_model_len": 256, "max_num_batched_tokens": 512, **kw}
    return ModelRunner(EngineConfig(**args), platform=platform)  # type: ignore[arg-type]


def test_kv_budget_is_utilization_minus_weights_and_profiled_peak(model_dir: Path) -> None:
    platform = FakeDevicePlatform(total=GIB, used_by_others=0, activation_peak=100 << 20)
    runner = _runner(model_dir, platform, gpu_memory_utilization=0.5)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    per_block = bytes_per_block(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    assert runner.num_blocks == (int(GIB * 0.5) - weights - (100 << 20)) // per_block
    assert platform.peak_resets == 1


def test_utilization_beyond_free_memory_says_lower_it(model_dir: Path) -> None:
    platform = FakeDevicePlatform(total=GIB, used_by_others=GIB // 2, activation_peak=0)
    with pytest.raises(StartupError) as info:
        _runner(model_dir, platform, gpu_memory_utilization=0.9)
    assert "lower --gpu-memory-utilization to 0.49 or less" in str(info.value)


def test_torch_out_of_memory_during_startup_names_the_flags(model_dir: Path) -> None:
    platform = FakeDevicePlatform(total=GIB, used_by_others=0, activation_peak=0, oom_on_forward=True)
    with pytest.raises(StartupError) as info:
        _runner(model_dir, platform)
    text = str(info.value)
    assert "out of fakedev memory" in text and "Tried to allocate 20.00 GiB" in text
    assert "lower --gpu-memory-utilization" in text


def test_device_cache_too_small_for_max_model_len(model_dir: Path) -> None:
    per_block = bytes_per_block(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    platform = FakeDevicePlatform(total=GIB, used_by_others=0, activation_peak=0)
    weights = _runner(model_dir, platform, gpu_memory_utilization=0.5).model
    weight_bytes = sum(p.numel() * p.element_size() for p in weights.parameters())
    # Room for 3 blocks where a 256-token sequence needs 16.
    utilization = (weight_bytes + 3 * per_block + 1) / GIB
    with pytest.raises(StartupError) as info:
        _runner(model_dir, FakeDevicePlatform(total=GIB, used_by_others=0, activation_peak=0),
                gpu_memory_utilization=utilization)  # fmt: skip
    text = str(info.value)
    assert "holds 3 blocks" in text and "needs 16" in text
    assert "lower --max-model-len, --max-num-seqs or --max-num-batched-tokens" in text
    assert "raise --gpu-memory-utilization" in text
