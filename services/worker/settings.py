"""Worker settings (flags and MESHSERVE_* variables)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from services.common.settings import ServiceSettings

DEFAULT_PORT = 50053
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from '4GiB', '512MiB', '2G' or a plain number of bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size; use e.g. 2GiB, 512MiB or a number of bytes")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


class WorkerSettings(ServiceSettings):
    """Model, device and KV-cache settings of one worker (one tensor-parallel group)."""

    port: int = Field(DEFAULT_PORT, description="health-check gRPC port", ge=0, le=65535)
    scheduler_address: str = Field("127.0.0.1:50052", description="scheduler host:port to attach to")
    model: str | None = Field(
        None, description="Hugging Face model directory or .gguf file (unset: the embedded SmolLM2)"
    )
    device: Literal["auto", "cpu", "cuda", "npu"] = Field("auto", description="device type")
    dtype: Literal["float32", "bfloat16", "fp32", "bf16"] = Field("float32", description="weights and compute")
    block_size: int = Field(16, description="tokens per KV block", ge=1, le=1024)
    kv_cache_memory: str = Field("2GiB", description="KV cache size on the CPU (e.g. 2GiB)")
    max_model_len: int | None = Field(None, description="longest sequence (unset: the model's)", ge=2)
    max_num_batched_tokens: int = Field(2048, description="largest step the worker must run", ge=1)
    max_num_seqs: int = Field(128, description="largest batch the worker must run", ge=1)
    seed: int = Field(0, description="seed of unseeded sampling")
    worker_id: str | None = Field(None, description="id shown to the scheduler (unset: host:pid)")
    reconnect_interval: float = Field(1.0, description="seconds between attach attempts", gt=0)

    @field_validator("kv_cache_memory")
    @classmethod
    def _valid_size(cls, value: str) -> str:
        parse_size(value)
        return value

    @property
    def kv_cache_memory_bytes(self) -> int:
        """--kv-cache-memory in bytes."""
        return parse_size(self.kv_cache_memory)
