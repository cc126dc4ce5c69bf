"""Which decoder layers each pipeline stage runs: contiguous spans balanced by parameter count (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayers:
    """One pipeline stage's share of the model: decoder layers [start, end), the embedding on the first stage,
    the final norm and LM head on the last."""

    index: int
    num_stages: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def whole_model(num_layers: int) -> StageLayers:
    """The one stage of a worker without pipeline parallelism."""
    return StageLayers(0, 1, 0, num_layers)


def partition_layers(
    num_layers: int,
    num_stages: int,
    *,
    layer_params: int,
    embed_params: int,
    head_params: int,
    override: Sequence[int] | None = None,
) -> list[StageLayers]:
    """Split num_layers into num_stages contiguous spans.

    Without an override (--pp-layer-partition) the spans minimise the largest stage's parameter count, the
    embedding counted on the first stage and the final norm and LM head on the last: each stage's weights
    are its memory, and the largest sets how much KV cache the ranks can agree on. Of equal splits, the one
    whose earlier stages hold more layers wins (as vLLM's): the last stage also computes logits and samples."""
    if num_stages < 1:
        raise ValueError(f"--pipeline-parallel-size must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {num_stages} exceeds the model's num_hidden_layers={num_layers}: every stage "
            f"needs at least one layer; pick at most {num_layers}"
        )
    counts = list(override) if override is not None else _balanced(num_layers, num_stages, layer_params,
                                                                    embed_params, head_params)  # fmt: skip
    if override is not None:
        _check_override(counts, num_layers, num_stages)
    stages = []
    start = 0
    for index, count in enumerate(counts):
        stages.append(StageLayers(index, num_stages, start, start + count))
        start += count
    return stages


def _check_override(counts: list[int], num_layers: int, num_stages: int) -> None:
    given = ",".join(str(c) for c in counts)
    if len(counts) != num_stages:
        raise ValueError(
            f"--pp-layer-partition {given} names {len(counts)} stages but --pipeline-parallel-size is {num_stages}; "
            "give one layer count per stage"
        )
    if min(counts) < 1:
        raise ValueError(f"--pp-layer-partition {given}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise ValueError(
            f"--pp-layer-partition {given} sums to {sum(counts)} layers but the model has "
            f"num_hidden_layers={num_layers}; make the counts add up to it"
        )


def _balanced(num_layers: int, num_stages: int, layer_params: int, embed_params: int, head_params: int) -> list[int]:
    """Layer counts per stage minimising the largest stage's parameters (exact, by dynamic programming)."""

    def cost(stage: int, count: int) -> int:
        extra = (embed_params if stage == 0 else 0) + (head_params if stage == num_stages - 1 else 0)
        return count * layer_params + extra

    # best[s][n]: (largest stage cost, counts) placing the first n layers on stages 0..s.
    best: list[dict[int, tuple[int, list[int]]]] = [{n: (cost(0, n), [n]) for n in range(1, num_layers + 1)}]
    for stage in range(1, num_stages):
        row: dict[int, tuple[int, list[int]]] = {}
        for n in range(stage + 1, num_layers + 1):
            options = []
            for count in range(1, n - stage + 1):
                worst, counts = best[stage - 1][n - count]
                options.append((max(worst, cost(stage, count)), [*counts, count]))
            # Smallest worst stage; then, of equals, the one whose earlier stages hold more layers.
            row[n] = min(options, key=lambda option: (option[0], [-c for c in option[1]]))
        best.append(row)
    return best[num_stages - 1][num_layers][1]
