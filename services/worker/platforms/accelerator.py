"""What CUDA and Ascend share: a torch runtime namespace (torch.cuda, torch.npu) with the same device API."""

from __future__ import annotations

from typing import Any

import torch

from services.worker.platforms.base import MemoryInfo, Platform


class TorchAcceleratorPlatform(Platform):
    """One device per rank, `<name>:<local_rank>`, driven through the runtime namespace in `_runtime`."""

    # torch.cuda, or torch.npu once torch_npu has registered it.
    _runtime: Any

    @property
    def device(self) -> torch.device:
        # "npu" parses once torch_npu has renamed torch's privateuse1 backend to it, which it does on import.
        return torch.device(self.name, self.local_rank)

    def set_device(self) -> None:
        self._runtime.set_device(self.local_rank)

    def device_count(self) -> int:
        return int(self._runtime.device_count())

    def memory_info(self) -> MemoryInfo:
        free, total = self._runtime.mem_get_info(self.local_rank)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def synchronize(self) -> None:
        self._runtime.synchronize(self.local_rank)

    def reset_peak_memory(self) -> None:
        self._runtime.reset_peak_memory_stats(self.local_rank)

    def peak_memory_bytes(self) -> int:
        return int(self._runtime.max_memory_allocated(self.local_rank))

    def empty_cache(self) -> None:
        self._runtime.empty_cache()
