"""CUDA platform: NCCL between ranks; reference ops, whose SDPA calls take torch's flash / efficient kernels."""

from __future__ import annotations

import torch

from services.worker.layers.attention import HND
from services.worker.platforms.accelerator import TorchAcceleratorPlatform
from services.worker.platforms.base import DeviceUnavailableError, Ops
from services.worker.platforms.reference_ops import ReferenceOps


class CudaPlatform(TorchAcceleratorPlatform):
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
                "lower --tensor-parallel-size (or --pipeline-parallel-size) or widen CUDA_VISIBLE_DEVICES"
            )
        self._runtime = torch.cuda
        self._ops = ReferenceOps(HND)

    @property
    def ops(self) -> Ops:
        return self._ops
