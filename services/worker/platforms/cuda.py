"""CUDA platform: NCCL between ranks; reference ops, whose SDPA calls take torch's flash / efficient kernels."""

from __future__ import annotations

import torch

from services.worker.layers.attention import HND
from services.worker.platforms.base import DeviceUnavailableError, MemoryInfo, Ops, Platform
from services.worker.platforms.cpu import ReferenceOps


class CudaPlatform(Platform):
    """One CUDA device per rank (cuda:local_rank among CUDA_VISIBLE_DEVICES)."""

    name = "cuda"
    dist_backend = "nccl"
    default_precision = "bf16-bf16-fp32"

    def __init__(self, local_rank: int = 0) -> None:
        super().__init__(local_rank)
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                "--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False; this torch "
                f"build has CUDA {torch.version.cuda or 'none'}); check `nvidia-smi`, CUDA_VISIBLE_DEVICES, "
                "and that a CUDA build of torch is installed, or use --device cpu"
            )
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DeviceUnavailableError(
                f"rank {local_rank} needs cuda:{local_rank} but only {count} CUDA device(s) are visible; "
                "lower --tensor-parallel-size or widen CUDA_VISIBLE_DEVICES"
            )
        self._ops = ReferenceOps(HND)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank)

    @property
    def ops(self) -> Ops:
        return self._ops

    def set_device(self) -> None:
        torch.cuda.set_device(self.local_rank)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self.local_rank)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.local_rank)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.local_rank)

    def peak_memory_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.local_rank))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
