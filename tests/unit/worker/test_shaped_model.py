"""Model directories of a published shape without weights (benchmarks' --load-format dummy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.gateway.tokenizer import TextTokenizer
from services.worker.benchmarks.shaped_model import SHAPES, write_shaped_model
from services.worker.grammar import GrammarEngine
from services.worker.models.llama import LlamaArch
from services.worker.weights import load_hf_config, resolve_model_path


def test_llama_3_8b_shape_is_the_published_one(tmp_path: Path) -> None:
    model_dir = write_shaped_model("llama-3-8b", tmp_path / "m")
    arch = LlamaArch.from_hf_config(load_hf_config(resolve_model_path(model_dir, need_weights=False)))
    params = arch.num_layers * arch.layer_params + 2 * arch.embedding_params + arch.hidden_size
    # Meta's Llama 3 8B: 8,030,261,248 parameters.
    assert params == 8_030_261_248
    assert (arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (8, 128, 128256)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 128001


def test_every_id_decodes_and_encodes_back(tmp_path: Path) -> None:
    model_dir = write_shaped_model("tiny", tmp_path / "m")
    vocab = SHAPES["tiny"]["vocab_size"]
    tokenizer = TextTokenizer.from_dir(model_dir)
    ids = list(range(vocab))
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<t0> <t1> ")
    assert tokenizer.encode(text) == ids
    # Structured outputs read the same tokenizer through llguidance.
    assert GrammarEngine(model_dir, vocab).eos_token_ids == {SHAPES["tiny"]["eos_token_id"]}


def test_unknown_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown shape 'llama-9'"):
        write_shaped_model("llama-9", tmp_path)
