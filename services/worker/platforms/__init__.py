"""Device platforms; get_platform picks one by name. torch_npu is imported only by the NPU probe."""

from __future__ import annotations

import structlog

from services.worker.engine_config import DEVICES
from services.worker.platforms.base import DeviceUnavailableError, MemoryInfo, Ops, Platform
from services.worker.platforms.cpu import CpuPlatform

__all__ = ["CpuPlatform", "DeviceUnavailableError", "MemoryInfo", "Ops", "Platform", "get_platform", "resolve_device"]

log = structlog.get_logger()


def resolve_device(name: str) -> str:
    """The concrete device type for --device NAME; `auto` takes npu, then cuda, then cpu."""
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"--device must be one of {list(DEVICES)}, got {name!r}")
    if key != "auto":
        return key
    from services.worker.platforms.npu import probe_npu

    npu = probe_npu()
    if npu.available:
        return "npu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    # Quietly expected on most machines, but say why an Ascend host fell back to the CPU.
    log.info("device_auto_cpu", npu_probe=npu.error, cuda=False)
    return "cpu"


def get_platform(name: str, local_rank: int = 0, cpu_kernels: str = "auto") -> Platform:
    """The platform for --device NAME (resolving `auto`), bound to the rank's local device index."""
    key = resolve_device(name)
    if key == "cpu":
        return CpuPlatform(local_rank, cpu_kernels)
    if key == "cuda":
        from services.worker.platforms.cuda import CudaPlatform

        return CudaPlatform(local_rank)
    from services.worker.platforms.npu import NpuPlatform

    return NpuPlatform(local_rank)
