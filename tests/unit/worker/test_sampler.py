"""Sampler: greedy, top-k / top-p filtering, and batch-independent seeds."""

from __future__ import annotations

import torch

from services.common.proto.meshserve.v1 import sampling_pb2
from services.worker.sampler import Sampler, SampleRequest, process_logits, token_seed

P = sampling_pb2.SamplingParams


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax() -> None:
    logits = _logits()
    out = Sampler().sample(logits, [SampleRequest(P(temperature=0), 0)] * 3)
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()
    assert all(s.logprob is None for s in out)


def test_top_k_one_is_argmax_even_when_hot() -> None:
    logits = _logits()
    out = Sampler(seed=5).sample(logits, [SampleRequest(P(temperature=5.0, top_k=1), i) for i in range(3)])
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


def test_top_p_tiny_is_argmax() -> None:
    logits = _logits()
    out = Sampler().sample(logits, [SampleRequest(P(top_p=1e-6), 0)] * 3)
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


def test_process_logits_masks() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = process_logits(row, P(top_k=2)).isfinite().tolist()
    assert kept == [True, True, False, False]
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is the first two.
    kept = process_logits(row, P(top_p=0.7)).isfinite().tolist()
    assert kept == [True, True, False, False]
    kept = process_logits(row, P(top_p=0.9)).isfinite().tolist()
    assert kept == [True, True, True, False]
    assert process_logits(row, P(top_k=-1)).isfinite().all()
    torch.testing.assert_close(process_logits(row, P(temperature=2.0)), row / 2)


def test_seeded_sampling_is_independent_of_batch_and_worker_state() -> None:
    logits = _logits(rows=4, vocab=200)
    params = P(temperature=1.0, seed=1234)
    alone = Sampler(seed=0).sample(logits[2:3], [SampleRequest(params, 7)])
    other = P(temperature=1.0)
    batched = Sampler(seed=99).sample(
        logits, [SampleRequest(other, 0), SampleRequest(other, 3), SampleRequest(params, 7), SampleRequest(other, 1)]
    )
    assert alone[0].token_id == batched[2].token_id


def test_different_seeds_and_indices_differ() -> None:
    row = torch.zeros(1, 1000)  # uniform: collisions are unlikely
    draws = {Sampler().sample(row, [SampleRequest(P(temperature=1.0, seed=s), 0)])[0].token_id for s in range(8)}
    assert len(draws) > 4
    by_index = {Sampler().sample(row, [SampleRequest(P(temperature=1.0, seed=1), i)])[0].token_id for i in range(8)}
    assert len(by_index) > 4


def test_token_seed_is_stable_63_bit() -> None:
    assert token_seed(1, 2) == token_seed(1, 2)
    assert token_seed(1, 2) != token_seed(2, 1)
    assert 0 <= token_seed(2**64 - 1, 10**6) < 2**63


def test_unseeded_follows_worker_seed() -> None:
    row = torch.zeros(1, 1000)
    req = [SampleRequest(P(temperature=1.0), 0)]
    a = [Sampler(seed=3).sample(row, req)[0].token_id for _ in range(1)]
    b = [Sampler(seed=3).sample(row, req)[0].token_id for _ in range(1)]
    assert a == b


def test_logprob_is_raw_model_logprob() -> None:
    logits = _logits(rows=1)
    out = Sampler().sample(logits, [SampleRequest(P(temperature=0.5, top_k=3, seed=1, logprobs=True), 0)])
    expected = torch.log_softmax(logits[0], -1)[out[0].token_id].item()
    assert out[0].logprob is not None
    assert abs(out[0].logprob - expected) < 1e-6
