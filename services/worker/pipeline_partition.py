"""Which decoder layers each pipeline stage runs: contiguous spans of balanced cost (pure Python)."""

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
    layer_cost: int,
    first_stage_cost: int,
    last_stage_cost: int,
    override: Sequence[int] | None = None,
) -> list[StageLayers]:
    """Split num_layers into num_stages contiguous spans.

    Without an override (--pp-layer-partition) the spans minimise the largest stage's cost: layer_cost for
    each decoder layer, plus first_stage_cost on the first stage and last_stage_cost on the last (what the
    embedding and the LM head add there). Of equal splits, the one whose earlier stages hold more layers
    wins (as vLLM's): the last stage also samples."""
    if num_stages < 1:
        raise ValueError(f"--pipeline-parallel-size must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {num_stages} exceeds the model's num_hidden_layers={num_layers}: every stage "
            f"needs at least one layer; pick at most {num_layers}"
        )
    if override is not None:
        counts = list(override)
        _check_override(counts, num_layers, num_stages)
    else:
        counts = _balanced(num_layers, num_stages, layer_cost, first_stage_cost, last_stage_cost)
    stages = []
    start = 0
    for index, count in enumerate(counts):
        stages.append(StageLayers(index, num_stages, start, start + count))
        start += count
    return stages


def partition_model(
    num_layers: int, num_stages: int, *, layer_params: int, vocab_params: int, override: Sequence[int] | None = None
) -> list[StageLayers]:
    """A decoder's stages, balanced by the weights each token's matmuls read: they set a stage's time per step,
    and the slowest stage sets the pipeline's pace (the others wait for it). The embedding (vocab_params on
    the first stage) is a lookup and costs nothing; the LM head (as many on the last) is a GEMM. Balancing
    parameters instead, embedding counted, left SmolLM2's last stage the bottleneck (docs/benchmarks.md)."""
    return partition_layers(num_layers, num_stages, layer_cost=layer_params, first_stage_cost=0,
                            last_stage_cost=vocab_params, override=override)  # fmt: skip


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


def _balanced(num_layers: int, num_stages: int, layer: int, first: int, last: int) -> list[int]:
    """Layer counts per stage minimising the largest stage's cost (exact, by dynamic programming)."""

    def cost(stage: int, count: int) -> int:
        return count * layer + (first if stage == 0 else 0) + (last if stage == num_stages - 1 else 0)

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
