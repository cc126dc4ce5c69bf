"""Model resolution, safetensors loading (sharded), name mapping checks and the fingerprint."""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import pytest
import torch

from services.common.kv_store_limits import is_valid_kv_format
from services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from services.worker.platforms import get_platform
from services.worker.precision import parse_precision
from services.worker.weights import (
    DUMMY_WEIGHT_RANGE,
    ModelSource,
    fill_dummy_weights,
    iter_weights,
    kv_format,
    load_hf_config,
    model_identity,
    resolve_model_path,
)
from tests.support.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("w"), model_type="qwen2", num_layers=1)


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights \(--load-format dummy"):
        resolve_model_path(tmp_path)
    # --load-format dummy reads the config alone.
    assert resolve_model_path(tmp_path, need_weights=False).directory == tmp_path.resolve()
    weird = tmp_path / "model.bin"
    weird.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        resolve_model_path(weird)


def test_gguf_source_and_name(tmp_path: Path) -> None:
    gguf = tmp_path / "Tiny-Model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    source = resolve_model_path(gguf)
    assert source.gguf_file == gguf.name and source.directory == tmp_path.resolve()
    assert source.name == "Tiny-Model.Q4_1"
    assert source.weight_files() == [tmp_path.resolve() / gguf.name]


def test_kv_format_covers_identity_dtype_and_block_size_only(tiny_dir: Path, tmp_path: Path) -> None:
    source = resolve_model_path(tiny_dir)
    base = kv_format(source, kv_dtype="float32", block_size=16)
    assert is_valid_kv_format(base)
    assert base == kv_format(resolve_model_path(tiny_dir), kv_dtype="float32", block_size=16)
    variants = {
        kv_format(source, kv_dtype="bfloat16", block_size=16),
        kv_format(source, kv_dtype="float32", block_size=32),
    }
    assert base not in variants and len(variants) == 2
    other = make_tiny_model(tmp_path / "other", model_type="qwen2", num_layers=2)
    assert kv_format(resolve_model_path(other), kv_dtype="float32", block_size=16) != base
    # Not part of it: the identity (which workers may serve) is the weights alone.
    assert model_identity(source) not in base


FP32 = parse_precision("fp32-fp32-fp32", platform_default="fp32-fp32-fp32")


def _empty_model(source: ModelSource) -> LlamaForCausalLM:
    return LlamaForCausalLM(load_hf_config(source), get_platform("cpu").ops, 64, FP32)


def test_load_weights_matches_checkpoint(tiny_dir: Path) -> None:
    source = resolve_model_path(tiny_dir)
    model = _empty_model(source)
    model.load_weights(iter_weights(source))
    state = dict(iter_weights(source))
    layer = cast(LlamaDecoderLayer, model.model.layers["0"])
    attn = layer.self_attn
    assert attn.qkv_proj.bias is not None
    _q, k, v = attn.qkv_proj.bias.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(k, state["model.layers.0.self_attn.k_proj.bias"])
    assert torch.equal(v, state["model.layers.0.self_attn.v_proj.bias"])
    _gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, state["model.layers.0.mlp.up_proj.weight"])


def test_load_weights_rejects_missing_unknown_and_misshaped(tiny_dir: Path) -> None:
    source = resolve_model_path(tiny_dir)
    state = dict(iter_weights(source))
    missing = {k: v for k, v in state.items() if "v_proj.weight" not in k}
    with pytest.raises(ValueError, match=re.escape("missing weights for: model.layers.0.self_attn.qkv_proj.weight#2")):
        _empty_model(source).load_weights(missing.items())
    with pytest.raises(ValueError, match="no matching parameter"):
        _empty_model(source).load_weights([*state.items(), ("model.extra.weight", torch.zeros(1))])
    bad = dict(state)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        _empty_model(source).load_weights(bad.items())


def test_sharded_safetensors_load_identically(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(sharded, max_shard_size="40KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    one = dict(iter_weights(resolve_model_path(tiny_dir)))
    many = dict(iter_weights(resolve_model_path(sharded)))
    assert one.keys() == many.keys()
    assert all(torch.equal(one[k], many[k]) for k in one)


def test_dummy_weights_are_another_model(tiny_dir: Path) -> None:
    """Random weights never share an identity (so a worker or a kvstore block) with the checkpoint's, and two
    seeds are two models."""
    source = resolve_model_path(tiny_dir)
    dummy = ModelSource(source.directory, dummy_seed=0)
    assert dummy.weight_files() == []
    identities = {model_identity(source), model_identity(dummy), model_identity(ModelSource(source.directory, None, 1))}
    assert len(identities) == 3
    assert model_identity(dummy) == model_identity(ModelSource(source.directory, dummy_seed=0))


def test_fill_dummy_weights_is_small_seeded_and_complete(tiny_dir: Path) -> None:
    platform = get_platform("cpu", cpu_kernels="reference")
    precision = parse_precision("fp32-fp32-fp32", platform_default="fp32-fp32-fp32")
    config = load_hf_config(resolve_model_path(tiny_dir))

    def filled(seed: int) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, platform.ops, 64, precision)
        model = model.to_empty(device="cpu")
        for param in model.parameters():
            param.data.fill_(float("nan"))
        fill_dummy_weights(model, seed)
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    first = filled(0)
    for name, tensor in first.items():
        assert tensor.isfinite().all(), name
        assert tensor.abs().max() <= DUMMY_WEIGHT_RANGE, name
        assert tensor.std() > 0, name
    assert all(torch.equal(first[n], t) for n, t in filled(0).items())
    assert not torch.equal(first["model.embed_tokens.weight"], filled(1)["model.embed_tokens.weight"])
