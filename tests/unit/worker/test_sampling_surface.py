"""The sampler's vLLM sampling surface, each feature against an independent per-row reference.

References are transformers' logits processors where one exists, or a plain per-row loop written here
(logit_bias, frequency / presence penalties, the token mask). The sampler under test runs whole mixed batches;
the references run one row at a time.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.worker.engine_config import EngineConfig
from services.worker.model_runner import ModelRunner
from services.worker.sampler import Sampler, SampleRequest, preprocess_logits, token_seed, warp_logits
from tests.support.tiny_model import make_tiny_model, transformers_greedy

P = sampling_pb2.SamplingParams
NEG_INF = float("-inf")


@dataclass
class Row:
    params: sampling_pb2.SamplingParams
    prompt: list[int] = field(default_factory=lambda: [1, 2, 3])
    output: list[int] = field(default_factory=list)
    eos: list[int] = field(default_factory=list)

    def request(self) -> SampleRequest:
        return SampleRequest.of(
            self.params, prompt_token_ids=self.prompt, output_token_ids=self.output, eos_token_ids=self.eos
        )


def _requests(rows: list[Row]) -> list[SampleRequest]:
    return [r.request() for r in rows]


def _randn(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _history(n: int, vocab: int, seed: int) -> list[int]:
    # Drawn from a narrow range so that tokens repeat (counts above 1).
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 12), (n,), generator=g).tolist()


def ref_preprocess(logits: torch.Tensor, row: Row, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """One row [V] through logit_bias, min_tokens, penalties and the mask, independently of the sampler."""
    p = row.params
    scores = logits.clone()[None]
    for token, value in p.logit_bias.items():
        scores[0, token] += value
    input_ids = torch.tensor([row.prompt + row.output], dtype=torch.int64)
    banned = row.eos + list(p.stop_token_ids)
    if p.HasField("min_tokens") and banned:
        scores = MinNewTokensLengthLogitsProcessor(len(row.prompt), p.min_tokens, banned)(input_ids, scores)
    if p.HasField("repetition_penalty"):
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
    for token, count in Counter(row.output).items():
        scores[0, token] -= p.frequency_penalty * count
        scores[0, token] -= p.presence_penalty
    if allowed is not None:
        scores[0, ~allowed] = NEG_INF
    return scores[0]


def ref_warp(logits: torch.Tensor, params: sampling_pb2.SamplingParams) -> torch.Tensor:
    """One sampled row [V] through temperature, min_p, top-k and top-p with transformers' warpers."""
    ids: Any = torch.zeros(1, 1, dtype=torch.int64)  # unused by the warpers; typed LongTensor there
    scores = logits.clone()[None]
    if params.HasField("temperature") and params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.HasField("top_p") and params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return scores[0]


def ref_token(logits: torch.Tensor, row: Row, allowed: torch.Tensor | None = None) -> int | None:
    """The reference token of a greedy or seeded row (None for an unseeded one)."""
    scores = ref_preprocess(logits, row, allowed)
    p = row.params
    if p.HasField("temperature") and p.temperature == 0:
        return int(scores.argmax())
    if not p.HasField("seed"):
        return None
    return ref_draw(torch.softmax(ref_warp(scores, p), dim=-1), token_seed(p.seed, len(row.output)))


def ref_draw(probs: torch.Tensor, seed: int) -> int:
    """The sampler's contract for a seeded draw: inverse CDF at u, the generator's first uniform."""
    u = float(torch.rand(1, generator=torch.Generator().manual_seed(seed))[0])
    cdf = probs.cumsum(dim=0).tolist()
    return bisect.bisect_right(cdf, u * cdf[-1])


def _assert_rows_close(actual: torch.Tensor, expected: torch.Tensor, row: int) -> None:
    assert torch.equal(actual.isfinite(), expected.isfinite()), f"row {row}: different tokens masked"
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"row {row}: {m}")


# --- each stage against its reference ---------------------------------------------------------------------


def _preprocess_rows(vocab: int) -> list[Row]:
    out = _history(6, vocab, 1)
    return [
        Row(P(temperature=0)),
        Row(P(logit_bias={3: 5.0, 7: -100.0, 20: 0.5})),
        # Before min_tokens: EOS and the stop id are banned.
        Row(P(min_tokens=4, stop_token_ids=[5]), output=out[:2], eos=[1, 2]),
        # At min_tokens: nothing is banned any more.
        Row(P(min_tokens=2, stop_token_ids=[5]), output=out[:2], eos=[1]),
        # Under ignore_eos the scheduler sends no EOS ids: only stop ids are banned.
        Row(P(min_tokens=2, stop_token_ids=[6]), output=out[:1]),
        Row(P(repetition_penalty=1.7), prompt=[9, 30, 31], output=out),
        Row(P(repetition_penalty=0.6), prompt=[4, 4, 40], output=out[:3]),
        Row(P(frequency_penalty=0.8), output=out),
        Row(P(presence_penalty=-1.5), output=out),
        Row(
            P(
                temperature=0.7,
                repetition_penalty=1.3,
                frequency_penalty=-0.5,
                presence_penalty=1.0,
                logit_bias={0: 2.0, 11: -3.0},
                min_tokens=10,
                stop_token_ids=[9],
            ),
            prompt=[25, 26, 0, 11],
            output=out[:5],
            eos=[2],
        ),
        Row(P(), output=out),
    ]


@pytest.mark.parametrize("masked", [False, True])
def test_preprocess_matches_per_row_reference(masked: bool) -> None:
    vocab = 48
    rows = _preprocess_rows(vocab)
    logits = _randn(len(rows), vocab, seed=2)
    allowed = None
    if masked:
        allowed = torch.rand(len(rows), vocab, generator=torch.Generator().manual_seed(3)) < 0.7
        allowed[:, 0] = True
    out = preprocess_logits(logits.clone(), _requests(rows), allowed)
    for i, row in enumerate(rows):
        _assert_rows_close(out[i], ref_preprocess(logits[i], row, None if allowed is None else allowed[i]), i)
    # Rows that use nothing are untouched (bit for bit) without a mask.
    if not masked:
        assert torch.equal(out[0], logits[0]) and torch.equal(out[3], logits[3])


def _warp_rows() -> list[Row]:
    return [
        Row(P(temperature=0.7, min_p=0.1)),
        Row(P(top_k=5)),
        Row(P(top_p=0.8)),
        Row(P(temperature=1.3, top_k=10, top_p=0.9)),
        Row(P(min_p=0.3, top_p=0.5)),
        Row(P()),
        Row(P(temperature=2.0)),
        Row(P(top_k=-1, top_p=1.0)),
        Row(P(top_k=1000)),
        Row(P(temperature=0.5, min_p=0.05, top_k=40, top_p=0.95)),
    ]


@pytest.mark.parametrize("only_top_k", [False, True])
def test_warp_matches_transformers_warpers(only_top_k: bool) -> None:
    rows = _warp_rows()
    if only_top_k:
        # No row with top_p: the top-k-only path (topk instead of a sort).
        rows = [Row(P(top_k=k, temperature=0.9)) for k in (1, 3, 17, 255)] + [Row(P(min_p=0.2))]
    logits = _randn(len(rows), 256, seed=4, scale=2.0)
    out = warp_logits(logits.clone(), _requests(rows))
    for i, row in enumerate(rows):
        _assert_rows_close(out[i], ref_warp(logits[i], row.params), i)


# --- each feature's behaviour -----------------------------------------------------------------------------


def _greedy_token(logits: torch.Tensor, row: Row) -> int:
    return Sampler().sample(logits[None], [row.request()])[0].token_id


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    row = torch.tensor([0.0, 1.0, 3.0, -1.0, 2.0, 0.5])
    assert _greedy_token(row, Row(P(temperature=0), prompt=[2])) == 2
    # 3.0 / 2 = 1.5 < 2.0: token 4 wins, whether token 2 was in the prompt or in the output.
    assert _greedy_token(row, Row(P(temperature=0, repetition_penalty=2.0), prompt=[2])) == 4
    assert _greedy_token(row, Row(P(temperature=0, repetition_penalty=2.0), prompt=[0], output=[2])) == 4
    # A negative logit is multiplied: -1 x 2 = -2.
    out = preprocess_logits(row[None].clone(), [Row(P(repetition_penalty=2.0), prompt=[3]).request()])
    assert out[0].tolist() == [0.0, 1.0, 3.0, -2.0, 2.0, 0.5]
    # Below 1 it rewards repetition instead.
    assert _greedy_token(row, Row(P(temperature=0, repetition_penalty=0.5), prompt=[4])) == 4


def test_frequency_and_presence_penalties_change_the_greedy_choice() -> None:
    row = torch.tensor([2.0, 1.5, 0.0])
    assert _greedy_token(row, Row(P(temperature=0, frequency_penalty=0.2), output=[0])) == 0
    # Counted per occurrence: 2.0 - 3 x 0.2 = 1.4 < 1.5.
    assert _greedy_token(row, Row(P(temperature=0, frequency_penalty=0.2), output=[0, 0, 0])) == 1
    # Presence does not count: 2.0 - 0.4 = 1.6 however often token 0 occurred.
    assert _greedy_token(row, Row(P(temperature=0, presence_penalty=0.4), output=[0, 0, 0])) == 0
    assert _greedy_token(row, Row(P(temperature=0, presence_penalty=0.6), output=[0])) == 1
    # The prompt does not count for these two.
    assert _greedy_token(row, Row(P(temperature=0, presence_penalty=2.0), prompt=[0, 0])) == 0


def test_min_tokens_bans_eos_and_stop_ids_until_the_count() -> None:
    vocab, eos, stop = 8, 7, 6
    logits = torch.zeros(vocab)
    logits[eos], logits[stop] = 20.0, 19.0
    for index in range(5):
        output = [0] * index
        greedy, seeded = P(temperature=0, min_tokens=3), P(seed=index, min_tokens=3)
        for params in (greedy, seeded):
            params.stop_token_ids.append(stop)
            row = Row(params, output=output, eos=[eos])
            token = Sampler().sample(logits[None], [row.request()])[0].token_id
            if index < 3:
                assert token not in (eos, stop), (index, params)
            else:
                assert token == eos, (index, params)
            ids = torch.tensor([row.prompt + output])
            expected = MinNewTokensLengthLogitsProcessor(len(row.prompt), 3, [eos, stop])(ids, logits[None])[0]
            assert torch.equal(preprocess_logits(logits[None].clone(), [row.request()])[0], expected)


def test_logit_bias_minus_100_bans_and_plus_100_forces() -> None:
    vocab = 100
    logits = _randn(1, vocab, seed=5)[0]
    top, bottom = int(logits.argmax()), int(logits.argmin())
    second = int(logits.topk(2).indices[1])
    sampler = Sampler(seed=1)
    kinds = [P(temperature=0), P(temperature=1.0), P(temperature=1.5, seed=3), P(temperature=1.0, top_p=0.9)]
    for kind in kinds:
        forced = P()
        forced.CopyFrom(kind)
        forced.logit_bias[bottom] = 100.0
        banned = P()
        banned.CopyFrom(kind)
        banned.logit_bias[top] = -100.0
        for index in range(20):
            reqs = [SampleRequest.of(forced, index), SampleRequest.of(banned, index)]
            out = sampler.sample(torch.stack([logits, logits]), reqs)
            assert out[0].token_id == bottom, kind
            assert out[1].token_id != top, kind
        if kind.temperature == 0:
            assert out[1].token_id == second


def test_min_p_drops_what_it_should() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = warp_logits(row[None].clone(), [SampleRequest.of(P(min_p=0.2))])[0].isfinite().tolist()
    # Threshold 0.2 x 0.5 = 0.1: only 0.05 goes.
    assert kept == [True, True, True, False]
    # 0.3 is not below 0.6 x 0.5 = 0.3: it stays.
    kept = warp_logits(row[None].clone(), [SampleRequest.of(P(min_p=0.6))])[0].isfinite().tolist()
    assert kept == [True, True, False, False]
    # After temperature: at T=2 the probabilities relative to the top are sqrt(p / 0.5) = 1, .77, .55, .32.
    kept = warp_logits(row[None].clone(), [SampleRequest.of(P(min_p=0.5, temperature=2.0))])[0].isfinite().tolist()
    assert kept == [True, True, True, False]
    ids: Any = torch.zeros(1, 1, dtype=torch.int64)
    expected = MinPLogitsWarper(0.5)(ids, row[None] / 2.0)
    assert expected[0].isfinite().tolist() == kept
    # Draws (one call for the unseeded batch) never pick the dropped token.
    draws = Sampler(seed=2).sample(row.repeat(400, 1), [SampleRequest.of(P(min_p=0.2))] * 400)
    assert {s.token_id for s in draws} == {0, 1, 2}


def test_top_logprobs_are_the_raw_distributions_top_k() -> None:
    vocab = 1000
    logits = _randn(7, vocab, seed=6)
    rows = [
        Row(P(temperature=0, logprobs=True, top_logprobs=5)),
        Row(P(temperature=0.8, seed=4, logprobs=True, top_logprobs=20)),
        Row(P(temperature=1.2, logprobs=True, top_logprobs=1)),
        Row(P(temperature=0, logprobs=True)),
        Row(P(temperature=0, top_logprobs=3)),  # without logprobs: nothing (the gateway rejects it)
        # Processing does not change what is reported: the raw distribution's logprobs.
        Row(P(temperature=0, repetition_penalty=3.0, logit_bias={7: 50.0}, logprobs=True, top_logprobs=3), [7, 8]),
        Row(P(temperature=0.5, top_k=2, min_p=0.1, logprobs=True, top_logprobs=20)),
    ]
    out = Sampler().sample(logits, _requests(rows))
    raw = torch.log_softmax(logits, dim=-1)
    for i, (row, s) in enumerate(zip(rows, out, strict=True)):
        if not row.params.logprobs:
            assert s.logprob is None and s.top_token_ids == () and s.top_logprobs == ()
            continue
        assert s.logprob is not None
        assert abs(s.logprob - raw[i, s.token_id].item()) < 1e-6
        k = row.params.top_logprobs
        assert len(s.top_token_ids) == len(s.top_logprobs) == k
        if k:
            ref = raw[i].topk(k)
            assert list(s.top_token_ids) == ref.indices.tolist(), i
            assert max(abs(a - b) for a, b in zip(s.top_logprobs, ref.values.tolist(), strict=True)) < 1e-6
    assert out[5].token_id == 7


def test_token_mask_is_honoured_by_greedy_and_sampled_rows() -> None:
    vocab = 50
    logits = _randn(6, vocab, seed=7)
    allowed = torch.rand(6, vocab, generator=torch.Generator().manual_seed(8)) < 0.3
    # The unmasked favourite of every row is forbidden, so an ignored mask shows.
    allowed[torch.arange(6), logits.argmax(dim=-1)] = False
    allowed[:, 1] = True
    rows = [
        Row(P(temperature=0)),
        Row(P(temperature=0, repetition_penalty=1.5), output=[1, 2]),
        Row(P(temperature=1.0, seed=1)),
        Row(P(temperature=2.0)),
        Row(P(temperature=1.0, top_k=3)),
        Row(P(temperature=1.0, min_p=0.5, top_p=0.5)),
    ]
    sampler = Sampler(seed=3)
    seen: set[int] = set()
    for index in range(30):
        reqs = [SampleRequest.of(r.params, index, prompt_token_ids=r.prompt, output_token_ids=r.output) for r in rows]
        out = sampler.sample(logits, reqs, allowed)
        for i, s in enumerate(out):
            assert allowed[i, s.token_id], (i, s.token_id)
        seen.add(out[3].token_id)
        assert out[0].token_id == int(logits[0].masked_fill(~allowed[0], NEG_INF).argmax())
    assert len(seen) > 3  # the hot row really sampled
    # A single allowed token is what every row gets.
    only = torch.zeros(6, vocab, dtype=torch.bool)
    only[:, 9] = True
    assert [s.token_id for s in sampler.sample(logits, _requests(rows), only)] == [9] * 6
    only[2] = False
    with pytest.raises(ValueError, match="allows no token"):
        sampler.sample(logits, _requests(rows), only)


# --- batches ----------------------------------------------------------------------------------------------


def test_seeded_rows_do_not_depend_on_their_batch() -> None:
    vocab = 5000
    target = Row(
        P(temperature=0.9, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.3, seed=77),
        prompt=_history(30, vocab, 9),
        output=_history(10, vocab, 10),
    )
    companions = [
        Row(P(temperature=0)),
        Row(P(temperature=1.0)),
        Row(P(temperature=0.5, top_k=7, frequency_penalty=1.0), output=[3, 3, 4]),
        Row(P(temperature=1.0, min_p=0.2, seed=5)),
        Row(P(temperature=0, logit_bias={1: 10.0}, min_tokens=5, stop_token_ids=[2])),
    ]
    row_logits = _randn(1, vocab, seed=11)
    for index in range(8):
        t = Row(target.params, target.prompt, target.output[:index])
        alone = Sampler(seed=0).sample(row_logits, [t.request()])[0].token_id
        for position, company in [(0, companions[:1]), (2, companions), (1, companions[2:4]), (3, companions[1:])]:
            rows = [*company[:position], t, *company[position:]]
            logits = _randn(len(rows), vocab, seed=100 + index + position)
            logits[position] = row_logits[0]
            out = Sampler(seed=index).sample(logits, _requests(rows))
            assert out[position].token_id == alone, (index, position)
        assert alone == ref_token(row_logits[0], t)


def _mixed_rows(vocab: int) -> list[Row]:
    out = _history(15, vocab, 12)
    return [
        Row(P(temperature=0)),
        Row(P(temperature=0, logprobs=True, top_logprobs=4, logit_bias={5: 4.0})),
        Row(P(temperature=0, repetition_penalty=1.8, frequency_penalty=0.5), output=out),
        Row(P(temperature=0.8, seed=1, top_p=0.9), output=out[:4]),
        Row(P(temperature=1.1, seed=2, top_k=20, min_p=0.05, presence_penalty=1.0, logprobs=True), output=out),
        Row(P(temperature=1.0, seed=3, min_tokens=20, stop_token_ids=[0], logit_bias={1: -100.0}), output=out[:3]),
        Row(P(temperature=0.7, seed=4, repetition_penalty=1.4), prompt=out[:6], output=out[6:9]),
        # Unseeded but deterministic: top_k=1 leaves one token, through temperature and penalties.
        Row(P(temperature=1.7, top_k=1, frequency_penalty=2.0, logprobs=True, top_logprobs=2), output=out),
        Row(P(temperature=1.0, top_k=1, repetition_penalty=2.0, min_p=0.5), output=out),
        # Unseeded and random: checked against the reference's support.
        Row(P(temperature=1.0, top_k=4, repetition_penalty=1.1), output=out),
        Row(P(temperature=0.6, top_p=0.5)),
    ]


@pytest.mark.parametrize("masked", [False, True])
def test_mixed_batch_rows_equal_each_row_alone(masked: bool) -> None:
    vocab = 3000
    rows = _mixed_rows(vocab)
    logits = _randn(len(rows), vocab, seed=13)
    allowed = None
    if masked:
        allowed = torch.rand(len(rows), vocab, generator=torch.Generator().manual_seed(14)) < 0.5
    batch = Sampler(seed=1).sample(logits, _requests(rows), allowed)
    for i, row in enumerate(rows):
        row_mask = None if allowed is None else allowed[i : i + 1]
        alone = Sampler(seed=2).sample(logits[i : i + 1], [row.request()], row_mask)[0]
        p = row.params
        deterministic = p.temperature == 0 or p.HasField("seed") or p.top_k == 1
        if deterministic:
            assert batch[i].token_id == alone.token_id, i
        else:
            support = ref_warp(ref_preprocess(logits[i], row, None if allowed is None else allowed[i]), p)
            assert support[batch[i].token_id].isfinite(), i
        reference = ref_token(logits[i], row, None if allowed is None else allowed[i])
        if reference is not None:
            assert batch[i].token_id == reference, i
        if p.top_k == 1:
            scores = ref_preprocess(logits[i], row, None if allowed is None else allowed[i])
            assert batch[i].token_id == int(scores.argmax()), i
        assert (batch[i].logprob is None) == (alone.logprob is None) == (not p.logprobs)
        if p.logprobs:
            got, want = batch[i].logprob, alone.logprob
            assert got is not None and want is not None
            assert abs(got - want) < 1e-6
            assert batch[i].top_token_ids == alone.top_token_ids
            assert len(batch[i].top_logprobs) == len(alone.top_logprobs) == p.top_logprobs


def test_seeded_pipeline_matches_the_transformers_reference() -> None:
    vocab = 300
    g = torch.Generator().manual_seed(15)
    rows: list[Row] = []
    for i in range(40):
        flags = torch.rand(7, generator=g).tolist()
        params = P(seed=1000 + i, temperature=0.5 + flags[0])
        if flags[1] < 0.5:
            params.top_k = 2 + i
        if flags[2] < 0.5:
            params.top_p = 0.5 + flags[2]
        if flags[3] < 0.4:
            params.min_p = flags[3] / 2
        if flags[4] < 0.5:
            params.repetition_penalty = 0.8 + flags[4]
        if flags[5] < 0.5:
            params.frequency_penalty = flags[5] * 2 - 0.5
            params.presence_penalty = 0.5 - flags[5]
        if flags[6] < 0.3:
            params.logit_bias[i] = 3.0
        if i % 5 == 0:
            params.temperature = 0
        rows.append(Row(params, prompt=_history(8, vocab, i), output=_history(i % 9, vocab, 50 + i)))
    logits = _randn(len(rows), vocab, seed=16)
    out = Sampler().sample(logits, _requests(rows))
    assert [s.token_id for s in out] == [ref_token(logits[i], r) for i, r in enumerate(rows)]


def test_unseeded_rows_follow_their_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 6000
    rows = [SampleRequest.of(P(top_k=3))] * n
    out = Sampler(seed=4).sample(torch.log(probs).repeat(n, 1), rows)
    freq = torch.bincount(torch.tensor([s.token_id for s in out]), minlength=4).float() / n
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert (freq - expected).abs().max() < 0.03, freq


def test_caller_logits_are_left_unchanged() -> None:
    vocab = 200
    rows = _mixed_rows(vocab)
    logits = _randn(len(rows), vocab, seed=17)
    before = logits.clone()
    allowed = torch.ones(len(rows), vocab, dtype=torch.bool)
    allowed[:, :10] = False
    Sampler().sample(logits, _requests(rows), allowed)
    Sampler().sample(logits, _requests(rows))
    # All rows sampled, nothing before the warpers and no temperature: the warpers' in-place stages.
    warped_only = [Row(P(top_k=3)), Row(P(min_p=0.2, seed=1)), Row(P(top_p=0.5)), Row(P(temperature=1.0))]
    Sampler().sample(logits[:4], _requests(warped_only))
    assert torch.equal(logits, before)
    # bf16 logits (a device model's dtype) are converted, and sampled the same as their float32 values.
    half = logits.bfloat16()
    reqs = _requests(rows)
    assert [s.token_id for s in Sampler(seed=1).sample(half, reqs)] == [
        s.token_id for s in Sampler(seed=1).sample(half.float(), reqs)
    ]


def test_ids_outside_the_vocabulary_are_ignored() -> None:
    logits = _randn(1, 20, seed=18)
    params = P(temperature=0, min_tokens=3, stop_token_ids=[10**6], frequency_penalty=1.0)
    out = Sampler().sample(logits, [SampleRequest.of(params, eos_token_ids=[-1, 25], output_token_ids=[99])])
    assert out[0].token_id == int(logits.argmax())


# --- through the model runner -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama-sampling"))


def _run(
    runner: ModelRunner, requests: dict[str, tuple[list[int], sampling_pb2.SamplingParams, list[int]]], steps: int
) -> dict[str, list[worker_pb2.SampledToken]]:
    """Prefill every request in one step, then decode them together: {request id: its SampledTokens}."""
    bs = runner.block_size
    out: dict[str, list[worker_pb2.SampledToken]] = {rid: [] for rid in requests}
    tokens = {rid: list(prompt) for rid, (prompt, _, _) in requests.items()}
    blocks: dict[str, list[int]] = {}
    free = iter(range(runner.num_blocks))
    for rid, (prompt, _, _) in requests.items():
        blocks[rid] = [next(free) for _ in range(math.ceil((len(prompt) + steps) / bs))]
    step = worker_pb2.Step(step_id=1)
    for rid, (prompt, params, eos) in requests.items():
        step.new_requests.append(
            worker_pb2.NewRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=params,
                block_ids=blocks[rid],
                num_computed_tokens=0,
                num_scheduled_tokens=len(prompt),
                eos_token_ids=eos,
            )
        )
    for n in range(steps):
        result = runner.execute(step)
        assert not result.error
        for s in result.sampled:
            out[s.request_id].append(s)
            tokens[s.request_id].append(s.token_id)
        step = worker_pb2.Step(step_id=n + 2)
        for rid in requests:
            step.scheduled.append(
                worker_pb2.ScheduledRequest(
                    request_id=rid, num_computed_tokens=len(tokens[rid]) - 1, num_scheduled_tokens=1
                )
            )
    return out


def test_runner_matches_transformers_generate_with_processors(model_dir: Path) -> None:
    runner = ModelRunner(
        EngineConfig(
            model_path=str(model_dir),
            dtype="float32",
            block_size=4,
            kv_cache_memory_bytes=1 << 22,
            max_num_batched_tokens=1024,
            max_num_seqs=8,
            max_model_len=128,
        )
    )
    prompt, plain_prompt, steps = [5, 9, 100, 200, 7, 8, 1, 2], [11, 12, 13], 8
    first = transformers_greedy(model_dir, prompt, 1)[0]
    params = P(
        temperature=0,
        logit_bias={42: 0.5},
        min_tokens=3,
        repetition_penalty=1.5,
        logprobs=True,
        top_logprobs=4,
    )
    out = _run(runner, {"proc": (prompt, params, [first]), "plain": (plain_prompt, P(temperature=0), [])}, steps)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    processors = LogitsProcessorList(
        [
            SequenceBiasLogitsProcessor([[[42], 0.5]]),
            MinNewTokensLengthLogitsProcessor(len(prompt), 3, [first]),
            RepetitionPenaltyLogitsProcessor(1.5),
        ]
    )
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            logits_processor=processors,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = generated.sequences[0, len(prompt) :].tolist()
    got = [s.token_id for s in out["proc"]]
    assert got == expected
    # The first greedy token is the EOS the request named: min_tokens kept it out of the first three.
    assert first not in got[:3]
    assert [s.token_id for s in out["plain"]] == transformers_greedy(model_dir, plain_prompt, steps)
    for s, raw in zip(out["proc"], generated.logits, strict=True):
        ref = torch.log_softmax(raw[0].float(), dim=-1)
        top = ref.topk(4)
        assert list(s.top_logprobs.token_ids) == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(s.top_logprobs.logprobs, top.values.tolist(), strict=True)) < 1e-4
        assert abs(s.logprob - ref[s.token_id].item()) < 1e-4
    assert all(not s.HasField("top_logprobs") for s in out["plain"])


def test_top_p_candidate_widths_agree_with_a_full_sort() -> None:
    # Peaked rows resolve in the first candidate width, flatter ones in the second, near-uniform ones only
    # with a full sort: the nucleus must be the same as transformers' on every row.
    vocab = 8192
    logits = torch.cat([_randn(2, vocab, seed=19, scale=s) for s in (6.0, 1.0, 0.3, 0.02, 1.0, 1.0)])
    rows = [Row(P(top_p=p)) for p in (0.9, 0.5) * 4]
    # Rows whose support top-k or min_p already cut below the first width, beside rows spread over V.
    rows += [Row(P(top_k=100, top_p=0.95)), Row(P(min_p=0.5, top_p=0.99, temperature=0.3))]
    rows += [Row(P(top_k=1000, top_p=0.95)), Row(P(top_k=100, top_p=0.05))]
    out = warp_logits(logits.clone(), _requests(rows))
    kept = out.isfinite().sum(dim=-1).tolist()
    assert kept[0] < 256 and 256 < kept[3] < 4096 and kept[2] > 4096, kept
    assert 1 < kept[8] < 100 and 1 < kept[9] < 256 and 256 < kept[10] < 1000, kept
    for i, row in enumerate(rows):
        _assert_rows_close(out[i], ref_warp(logits[i], row.params), i)


def test_non_contiguous_logits_are_sampled_as_their_values() -> None:
    rows = _mixed_rows(64)
    logits = _randn(64, len(rows), seed=20).t()
    assert not logits.is_contiguous()
    got = [s.token_id for s in Sampler(seed=1).sample(logits, _requests(rows))]
    assert got == [s.token_id for s in Sampler(seed=1).sample(logits.contiguous(), _requests(rows))]


def test_empty_batch_and_shape_errors() -> None:
    assert Sampler().sample(torch.zeros(0, 10), []) == []
    with pytest.raises(ValueError, match="for 2 requests"):
        Sampler().sample(torch.zeros(3, 10), [SampleRequest.of(P())] * 2)
    with pytest.raises(ValueError, match="token mask of shape"):
        Sampler().sample(torch.zeros(1, 10), [SampleRequest.of(P())], torch.ones(1, 9, dtype=torch.bool))
