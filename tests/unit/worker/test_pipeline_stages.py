"""A model split into pipeline stages: each stage loads only its weights, and stages chained by their
(hidden, residual) hand-off compute exactly what the whole model does."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from services.worker.kv_cache import KVCache
from services.worker.layers.attention import AttentionMetadata
from services.worker.models.llama import LlamaArch, LlamaDecoderLayer, LlamaForCausalLM
from services.worker.pipeline_partition import StageLayers, partition_layers, partition_model
from services.worker.platforms import get_platform
from services.worker.precision import parse_precision
from services.worker.weights import iter_weights, load_hf_config, resolve_model_path
from tests.support.tiny_model import make_tiny_model

FP32 = parse_precision("fp32-fp32-fp32", platform_default="fp32-fp32-fp32")
BLOCK = 16


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("stages"), num_layers=5, tie_word_embeddings=request.param)


OPS = get_platform("cpu", 0, "reference").ops


def _model(model_dir: Path, stage: StageLayers | None) -> LlamaForCausalLM:
    source = resolve_model_path(model_dir)
    model = LlamaForCausalLM(load_hf_config(source), OPS, 128, FP32, stage=stage)
    model.load_weights(iter_weights(source))
    return model.eval()


def _run(model: LlamaForCausalLM, tokens: list[int], carried: tuple[torch.Tensor, torch.Tensor] | None):  # type: ignore[no-untyped-def]
    n = len(tokens)
    blocks = -(-n // BLOCK)
    cache = KVCache.allocate(num_blocks=blocks, num_layers=model.stage.num_layers, block_size=BLOCK,
                             num_kv_heads=model.num_kv_heads, head_dim=model.arch.head_dim, dtype=torch.float32,
                             device=torch.device("cpu"), layout=OPS.kv_layout)  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        block_tables=torch.arange(blocks).unsqueeze(0),
    )
    with torch.inference_mode():
        return model(torch.tensor(tokens), torch.arange(n), cache.layers, meta, carried)


def test_chained_stages_compute_what_the_whole_model_does(model_dir: Path) -> None:
    tokens = list(range(40, 77))
    whole = _model(model_dir, None)
    expected, _ = _run(whole, tokens, None)
    arch: LlamaArch = whole.arch
    stages = partition_model(arch.num_layers, 3, layer_params=arch.layer_params, vocab_params=arch.embedding_params)
    carried = None
    for stage in stages:
        hidden, residual = _run(_model(model_dir, stage), tokens, carried)
        if stage.is_last:
            assert residual is None
            final = hidden
        else:
            assert residual is not None
            carried = (hidden, residual)
    torch.testing.assert_close(final, expected, rtol=0, atol=0)
    last = _model(model_dir, stages[-1])
    torch.testing.assert_close(last.compute_logits(final), whole.compute_logits(expected), rtol=0, atol=0)


def test_each_stage_holds_only_its_own_weights(model_dir: Path) -> None:
    first, last = (_model(model_dir, s) for s in partition_layers(5, 2, layer_cost=10, first_stage_cost=0,
                                                                  last_stage_cost=0))  # fmt: skip
    assert sorted(first.model.layers.keys(), key=int) == ["0", "1", "2"]
    assert sorted(last.model.layers.keys(), key=int) == ["3", "4"]
    assert first.model.embed_tokens is not None and first.model.norm is None and first.lm_head is None
    assert last.model.embed_tokens is None and last.model.norm is not None and last.lm_head is not None
    assert len(first.matmul_modules()) == 3 * 2 * 2 and len(last.matmul_modules()) == 2 * 2 * 2 + 1
    with pytest.raises(AssertionError, match="only the last pipeline stage has the LM head"):
        first.head()
    whole = _model(model_dir, None)
    # A tied checkpoint's head on the last stage is a copy of the embedding; an untied one is its own.
    expected_head = whole.head().weight
    torch.testing.assert_close(last.head().weight, expected_head, rtol=0, atol=0)
    mine, theirs = (cast(LlamaDecoderLayer, m.model.layers["4"]) for m in (last, whole))
    torch.testing.assert_close(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight, rtol=0, atol=0)


def test_a_stage_missing_its_weights_names_them(model_dir: Path) -> None:
    source = resolve_model_path(model_dir)
    stage = StageLayers(1, 2, 3, 5)
    model = LlamaForCausalLM(load_hf_config(source), OPS, 128, FP32, stage=stage)
    without_layer_4 = ((n, t) for n, t in iter_weights(source) if not n.startswith("model.layers.4."))
    with pytest.raises(ValueError, match=r"missing weights for: model\.layers\.4\."):
        model.load_weights(without_layer_4)
