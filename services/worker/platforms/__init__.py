"""Device platforms; get_platform picks one by name. torch_npu is never imported here."""

from __future__ import annotations

from services.worker.platforms.base import MemoryInfo, Ops, Platform
from services.worker.platforms.cpu import CpuPlatform

__all__ = ["CpuPlatform", "MemoryInfo", "Ops", "Platform", "get_platform"]

_NOT_YET = ("cuda", "npu")


def get_platform(name: str) -> Platform:
    """Return the platform for --device NAME ("cpu", or "auto" which picks cpu in this build)."""
    key = name.strip().lower()
    if key in ("cpu", "auto"):
        return CpuPlatform()
    if key in _NOT_YET:
        raise ValueError(f"--device {key} is not available yet in this build; use --device cpu")
    raise ValueError(f"--device must be one of ['auto', 'cpu', 'cuda', 'npu'], got {name!r}")
