"""Layer spans of pipeline stages: contiguous, covering the model, balanced by parameters, or as given."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from services.worker.pipeline_partition import StageLayers, partition_layers, partition_model, whole_model

# SmolLM2-135M's shapes: 30 layers of ~3.5M parameters, an embedding (and tied head copy) of ~28M.
SMOLLM2: dict[str, Any] = {"layer_cost": 3_540_096, "first_stage_cost": 28_311_552, "last_stage_cost": 28_311_552}


def _counts(stages: list[StageLayers]) -> list[int]:
    return [s.num_layers for s in stages]


def _worst(counts: list[int], layer: int, embed: int, head: int) -> int:
    last = len(counts) - 1
    return max(c * layer + (embed if i == 0 else 0) + (head if i == last else 0) for i, c in enumerate(counts))


def test_stages_are_contiguous_and_cover_every_layer() -> None:
    stages = partition_layers(30, 4, **SMOLLM2)
    assert [(s.index, s.num_stages) for s in stages] == [(i, 4) for i in range(4)]
    assert stages[0].start == 0 and stages[-1].end == 30
    assert all(a.end == b.start for a, b in itertools.pairwise(stages))
    assert stages[0].is_first and stages[-1].is_last and not stages[1].is_first and not stages[1].is_last


def test_the_embedding_and_head_weigh_on_the_outer_stages() -> None:
    assert _counts(partition_layers(30, 2, **SMOLLM2)) == [15, 15]
    # The embedding weighs about 8 layers: the outer stages of four get fewer layers.
    assert _counts(partition_layers(30, 4, **SMOLLM2)) == [4, 11, 11, 4]
    assert _counts(partition_layers(8, 3, layer_cost=10, first_stage_cost=0, last_stage_cost=0)) == [3, 3, 2]


@pytest.mark.parametrize(("num_layers", "num_stages"), [(7, 3), (9, 4), (6, 2), (10, 5)])
@pytest.mark.parametrize(("embed", "head"), [(0, 0), (25, 5), (3, 40)])
def test_the_split_is_the_best_possible(num_layers: int, num_stages: int, embed: int, head: int) -> None:
    got = _counts(partition_layers(num_layers, num_stages, layer_cost=10, first_stage_cost=embed, last_stage_cost=head))
    every = [list(c) for c in itertools.product(range(1, num_layers + 1), repeat=num_stages) if sum(c) == num_layers]
    best = min(_worst(c, 10, embed, head) for c in every)
    assert sum(got) == num_layers and min(got) >= 1
    assert _worst(got, 10, embed, head) == best


def test_a_model_is_split_by_the_work_of_its_matmuls() -> None:
    # The embedding is a lookup; the LM head a GEMM the size of eight SmolLM2 layers, on the last stage.
    smollm2: dict[str, Any] = {"layer_params": 3_540_096, "vocab_params": 28_311_552}
    assert _counts(partition_model(30, 2, **smollm2)) == [19, 11]
    assert _counts(partition_model(30, 4, **smollm2)) == [10, 10, 9, 1]
    assert _counts(partition_model(30, 2, **smollm2, override=[15, 15])) == [15, 15]


def test_equal_splits_give_the_earlier_stages_more_layers() -> None:
    # The last stage also computes logits and samples.
    assert _counts(partition_layers(3, 2, layer_cost=10, first_stage_cost=0, last_stage_cost=0)) == [2, 1]


def test_an_override_is_taken_as_given() -> None:
    assert _counts(partition_layers(30, 2, **SMOLLM2, override=[20, 10])) == [20, 10]


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "override", "message"),
    [
        (4, 5, None, "--pipeline-parallel-size 5 exceeds the model's num_hidden_layers=4"),
        (4, 0, None, "--pipeline-parallel-size must be >= 1"),
        (4, 2, [2, 1], "--pp-layer-partition 2,1 sums to 3 layers but the model has num_hidden_layers=4"),
        (4, 2, [4], "--pp-layer-partition 4 names 1 stages but --pipeline-parallel-size is 2"),
        (4, 2, [4, 0], "every stage needs at least one layer"),
    ],
)
def test_a_split_that_cannot_work_names_the_flag(
    num_layers: int, num_stages: int, override: list[int] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        partition_layers(num_layers, num_stages, layer_cost=1, first_stage_cost=1, last_stage_cost=1, override=override)


def test_whole_model_is_one_stage_with_every_layer() -> None:
    stage = whole_model(12)
    assert (stage.start, stage.end, stage.is_first, stage.is_last) == (0, 12, True, True)
