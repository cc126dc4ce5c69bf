"""EngineConfig validation and precision / block-size resolution."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine_config import EngineConfig
from services.worker.precision import parse_precision


def test_dtype_is_shorthand_for_one_dtype_everywhere() -> None:
    precision = EngineConfig(model_path="m", dtype="bfloat16").resolve_precision("fp32-fp32-fp32")
    assert precision.name == "bf16-bf16-bf16"
    assert precision.weights == precision.compute == precision.accum == torch.bfloat16


def test_auto_takes_the_platform_default() -> None:
    assert EngineConfig(model_path="m").resolve_precision("bf16-fp16-fp32").name == "bf16-fp16-fp32"
    config = EngineConfig(model_path="m", precision="auto", dtype="fp32")
    assert config.resolve_precision("bf16-fp16-fp32").name == "fp32-fp32-fp32"


def test_precision_parts() -> None:
    p = EngineConfig(model_path="m", precision="BF16-float16-fp32").resolve_precision("fp32-fp32-fp32")
    assert (p.weights, p.compute, p.accum, p.kv_dtype) == (torch.bfloat16, torch.float16, torch.float32, torch.float16)
    assert p.name == "bf16-fp16-fp32"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bf16-fp8-fp32", "COMPUTE 'fp8' is not one of fp32, bf16, fp16"),
        ("int8-bf16-fp32", "WEIGHTS 'int8' is not one of"),
        ("bf16-fp16", "must be WEIGHTS-COMPUTE-ACCUM"),
        ("bf16-fp32-fp16", "ACCUM must be fp32 or equal to COMPUTE (fp32); got fp16"),
        ("fp32-bf16-fp16", "ACCUM must be fp32 or equal to COMPUTE (bf16)"),
    ],
)
def test_unknown_precisions_are_refused_with_the_part_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="--precision") as info:
        parse_precision(text, platform_default="fp32-fp32-fp32")
    assert message in str(info.value)
    with pytest.raises(ValueError, match="--precision"):
        EngineConfig(model_path="m", precision=text)


def test_dtype_and_precision_together_are_refused() -> None:
    with pytest.raises(ValueError, match="either --dtype or --precision"):
        EngineConfig(model_path="m", dtype="bf16", precision="bf16-fp16-fp32")


def test_block_size_follows_the_platform() -> None:
    assert EngineConfig(model_path="m").resolve_block_size("cpu", None) == 16
    assert EngineConfig(model_path="m", block_size=32).resolve_block_size("cpu", None) == 32
    assert EngineConfig(model_path="m").resolve_block_size("npu", 128) == 128
    with pytest.raises(ValueError, match=r"--block-size 16 is not supported on npu: .* need 128"):
        EngineConfig(model_path="m", block_size=16).resolve_block_size("npu", 128)


def test_step_budget_is_the_flag_or_the_platforms() -> None:
    assert EngineConfig(model_path="m").resolve_max_num_batched_tokens(512) == 512
    assert EngineConfig(model_path="m", max_num_batched_tokens=4096).resolve_max_num_batched_tokens(512) == 4096


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"dtype": "int8"}, "--dtype"),
        ({"device": "tpu"}, "--device"),
        ({"block_size": 0}, "--block-size"),
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
        ({"kv_cache_memory_bytes": 0}, "--kv-cache-memory"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
        ({"max_model_len": 0}, "--max-model-len"),
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"seed": -1}, "--seed"),
        ({"model_path": ""}, "--model"),
        ({"load_format": "pt"}, "--load-format"),
        ({"load_format": "dummy", "quantization": "gguf", "model_path": "m.gguf"}, "--load-format dummy"),
    ],
)
def test_invalid_values_name_the_flag(kwargs: dict[str, object], flag: str) -> None:
    args: dict[str, object] = {"model_path": "m", **kwargs}
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**args)  # type: ignore[arg-type]
