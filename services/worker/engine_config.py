"""Static configuration of one worker engine (model, dtype, device, KV budget, batch limits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
_DEVICES = ("cpu", "cuda", "npu", "auto")


@dataclass(frozen=True)
class EngineConfig:
    """What the worker loads and how much it may batch; validated on construction."""

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("--model must name a Hugging Face directory or a .gguf file")
        canonical = _DTYPE_ALIASES.get(self.dtype.lower())
        if canonical is None:
            raise ValueError(f"--dtype must be one of {sorted(_DTYPE_ALIASES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", canonical)
        if self.device not in _DEVICES:
            raise ValueError(f"--device must be one of {list(_DEVICES)}, got {self.device!r}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of weights and KV cache."""
        return torch.float32 if self.dtype == "float32" else torch.bfloat16
