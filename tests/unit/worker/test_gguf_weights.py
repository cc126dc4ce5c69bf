"""Reading a GGUF file's quantised blocks as they are (--quantization gguf), against gguf-py and transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.gguf_weights import decode_blocks, hf_matmul_name, read_matmul_weights
from services.worker.layers.quantization import (
    Int4Weight,
    Int8Weight,
    cat_weight_rows,
    pad_weight_rows,
    quantize_int4,
    weight_columns,
    weight_rows,
)
from tests.support.tiny_gguf import make_tiny_gguf


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_decode_to_ggufs_own_dequantisation(kind: str) -> None:
    import gguf
    import gguf.quants

    rng = np.random.default_rng(0)
    # Three blocks a row (an odd count), values with a wide range of scales.
    values = (rng.normal(size=(5, 96)) * rng.uniform(0.01, 3, size=(5, 1))).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(values, qtype)
    weight = decode_blocks(kind, blocks, 96)
    assert isinstance(weight, Int8Weight if kind == "Q8_0" else Int4Weight)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert torch.equal(weight.dequantize(torch.float32), expected)


def test_names_map_to_the_models_matmuls() -> None:
    assert hf_matmul_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_matmul_name("blk.11.ffn_down.weight") == "model.layers.11.mlp.down_proj.weight"
    assert hf_matmul_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_matmul_name("output.weight") == "lm_head.weight"
    for other in ("blk.3.attn_norm.weight", "output_norm.weight", "blk.0.attn_q.bias", "rope_freqs.weight"):
        assert hf_matmul_name(other) is None


@pytest.mark.parametrize("tied", [True, False])
def test_every_quantised_weight_is_the_tensor_transformers_loads(tmp_path: Path, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_gguf(tmp_path / "tiny.gguf", formats={"ffn_up": "F16"}, tie_word_embeddings=tied)
    found = read_matmul_weights(path, num_heads=4, num_kv_heads=2)
    # F16 has no kernel: those stay with the dense weights.
    assert found.dense == {f"model.layers.{i}.mlp.up_proj.weight": "F16" for i in range(2)}
    expected_names = {"model.embed_tokens.weight"} | ({"lm_head.weight"} if not tied else set())
    expected_names |= {
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj")
    }
    expected_names |= {f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)}
    assert set(found.quantized) == expected_names
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    state = model.state_dict()
    for name, weight in found.quantized.items():
        # Bit for bit, the q and k rows included (llama.cpp permuted them; both readers undo it).
        assert torch.equal(weight.dequantize(torch.float32), state[name]), name


def test_shards_cut_on_block_boundaries_only() -> None:
    weight = quantize_int4(torch.randn(6, 128))
    dense = weight.dequantize(torch.float32)
    assert torch.equal(weight_columns(weight, 64, 64).dequantize(torch.float32), dense[:, 64:])
    assert torch.equal(weight_rows(weight, 2, 3).dequantize(torch.float32), dense[2:5])
    with pytest.raises(ValueError, match="do not fall on its blocks of 32 columns"):
        weight_columns(weight, 16, 64)
    parts = cat_weight_rows([weight_rows(weight, 0, 2), weight_rows(weight, 2, 4)])
    assert torch.equal(parts.dequantize(torch.float32), dense)
    padded = pad_weight_rows(weight, 8).dequantize(torch.float32)
    assert torch.equal(padded[:6], dense) and not padded[6:].any()
    int8 = Int8Weight(torch.ones(6, 128, dtype=torch.int8), torch.ones(6, 4))
    with pytest.raises(ValueError, match="fused parts in different formats"):
        cat_weight_rows([weight, int8])
    with pytest.raises(ValueError, match="do not fall on its blocks of 32 columns"):
        weight_columns(int8, 8, 32)
