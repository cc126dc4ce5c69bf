"""EngineConfig validation."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine_config import EngineConfig


def test_dtype_aliases_are_canonicalised() -> None:
    assert EngineConfig(model_path="m", dtype="bf16").dtype == "bfloat16"
    assert EngineConfig(model_path="m", dtype="fp32").torch_dtype == torch.float32
    assert EngineConfig(model_path="m", dtype="bfloat16").torch_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"dtype": "float16"}, "--dtype"),
        ({"device": "tpu"}, "--device"),
        ({"block_size": 0}, "--block-size"),
        ({"kv_cache_memory_bytes": 0}, "--kv-cache-memory"),
        ({"max_model_len": 0}, "--max-model-len"),
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"seed": -1}, "--seed"),
        ({"model_path": ""}, "--model"),
    ],
)
def test_invalid_values_name_the_flag(kwargs: dict[str, object], flag: str) -> None:
    args: dict[str, object] = {"model_path": "m", **kwargs}
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**args)  # type: ignore[arg-type]
