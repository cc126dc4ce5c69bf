"""Device parameters for equality tests: the CPU always, CUDA where this machine has enough GPUs."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def device_params(min_cuda_devices: int = 1) -> list[Any]:
    """pytest params "cpu" and "cuda"; cuda is skipped, with the reason shown, below min_cuda_devices GPUs."""
    count = torch.cuda.device_count()
    reason = f"needs {min_cuda_devices} CUDA device(s); this machine has {count}"
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(count < min_cuda_devices, reason=reason)),
    ]
