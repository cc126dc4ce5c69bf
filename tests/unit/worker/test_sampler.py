"""Sampler: greedy, top-k / top-p filtering, and batch-independent seeds."""

from __future__ import annotations

import torch

from services.common.proto.meshserve.v1 import sampling_pb2
from services.worker.logits_processing import apply_top_k, apply_top_p
from services.worker.sampler import Sampler, SampleRequest, token_seed

P = sampling_pb2.SamplingParams


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax() -> None:
    logits = _logits()
    out = Sampler().sample(logits, [SampleRequest.of(P(temperature=0), 0)] * 3)
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()
    assert all(s.logprob is None for s in out)


def test_top_k_one_is_argmax_even_when_hot() -> None:
    logits = _logits()
    out = Sampler(seed=5).sample(logits, [SampleRequest.of(P(temperature=5.0, top_k=1), i) for i in range(3)])
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


def test_top_p_tiny_is_argmax() -> None:
    logits = _logits()
    out = Sampler().sample(logits, [SampleRequest.of(P(top_p=1e-6), 0)] * 3)
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


def _kept_top_k_top_p(row: torch.Tensor, k: int, p: float) -> list[bool]:
    out = row[None].clone()
    if 0 < k < row.shape[0]:
        out = apply_top_k(out, torch.tensor([k]))
    if p < 1.0:
        out = apply_top_p(out, torch.tensor([p]))
    return out[0].isfinite().tolist()


def test_top_k_top_p_masks() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert _kept_top_k_top_p(row, 2, 1.0) == [True, True, False, False]
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is the first two.
    assert _kept_top_k_top_p(row, 0, 0.7) == [True, True, False, False]
    assert _kept_top_k_top_p(row, 0, 0.9) == [True, True, True, False]
    # Top-p applies to what top-k kept: renormalised, 0.5 / 0.8 < 0.7 needs the second token too.
    assert _kept_top_k_top_p(row, 2, 0.7) == [True, True, False, False]
    assert _kept_top_k_top_p(row, 2, 0.6) == [True, False, False, False]
    assert _kept_top_k_top_p(row, 0, 1.0) == [True, True, True, True]
    # Ties with the k-th are kept, as transformers' TopKLogitsWarper does.
    tied = torch.tensor([1.0, 2.0, 2.0, 0.5])
    assert _kept_top_k_top_p(tied, 2, 1.0) == [False, True, True, False]
    assert _kept_top_k_top_p(tied, 1, 1.0) == [False, True, True, False]
    # The row order of the vocabulary does not matter.
    shuffled = row[torch.tensor([2, 0, 3, 1])]
    assert _kept_top_k_top_p(shuffled, 0, 0.7) == [False, True, False, True]


def test_seeded_sampling_is_independent_of_batch_and_worker_state() -> None:
    logits = _logits(rows=4, vocab=200)
    params = P(temperature=1.0, seed=1234)
    alone = Sampler(seed=0).sample(logits[2:3], [SampleRequest.of(params, 7)])
    other = P(temperature=1.0)
    batched = Sampler(seed=99).sample(
        logits,
        [
            SampleRequest.of(other, 0),
            SampleRequest.of(other, 3),
            SampleRequest.of(params, 7),
            SampleRequest.of(other, 1),
        ],
    )
    assert alone[0].token_id == batched[2].token_id


def test_different_seeds_and_indices_differ() -> None:
    row = torch.zeros(1, 1000)  # uniform: collisions are unlikely
    draws = {Sampler().sample(row, [SampleRequest.of(P(temperature=1.0, seed=s), 0)])[0].token_id for s in range(8)}
    assert len(draws) > 4
    by_index = {Sampler().sample(row, [SampleRequest.of(P(temperature=1.0, seed=1), i)])[0].token_id for i in range(8)}
    assert len(by_index) > 4


def test_token_seed_is_stable_63_bit() -> None:
    assert token_seed(1, 2) == token_seed(1, 2)
    assert token_seed(1, 2) != token_seed(2, 1)
    assert 0 <= token_seed(2**64 - 1, 10**6) < 2**63


def test_unseeded_follows_worker_seed() -> None:
    row = torch.zeros(1, 1000)
    req = [SampleRequest.of(P(temperature=1.0), 0)]
    a = [Sampler(seed=3).sample(row, req)[0].token_id for _ in range(1)]
    b = [Sampler(seed=3).sample(row, req)[0].token_id for _ in range(1)]
    assert a == b


def test_logprob_is_raw_model_logprob() -> None:
    logits = _logits(rows=1)
    out = Sampler().sample(logits, [SampleRequest.of(P(temperature=0.5, top_k=3, seed=1, logprobs=True), 0)])
    expected = torch.log_softmax(logits[0], -1)[out[0].token_id].item()
    assert out[0].logprob is not None
    assert abs(out[0].logprob - expected) < 1e-6
