"""The worker verifies draft tokens (speculative decoding): what it keeps is what one-token decoding gives,
whatever the drafts were, and a wrong draft's KV never leaks into later steps."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.common.speculation import MAX_DRAFT_TOKENS
from services.worker.engine_config import EngineConfig
from services.worker.model_runner import ModelRunner
from tests.support.tiny_model import make_tiny_model, transformers_greedy

GREEDY = sampling_pb2.SamplingParams(temperature=0)
BS = 4
PROMPT = [5, 9, 100, 200, 7, 8, 1, 2, 3, 4, 250]
MAX_NEW = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    config = EngineConfig(
        model_path=str(model_dir),
        dtype="float32",
        block_size=BS,
        kv_cache_memory_bytes=1 << 22,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        max_model_len=128,
    )
    return ModelRunner(config)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[int]:
    return transformers_greedy(model_dir, PROMPT, MAX_NEW)


class OneRequest:
    """Plays the scheduler for one request: prefill, then decodes that carry whatever drafts it is given."""

    def __init__(self, runner: ModelRunner, rid: str, params: sampling_pb2.SamplingParams = GREEDY) -> None:
        self.runner, self.rid, self.params = runner, rid, params
        self.tokens = list(PROMPT)
        self.blocks = list(range(runner.num_blocks))[::-1][: -(-128 // BS)]
        self.step_id = 0
        self.num_computed = 0
        self.gained: list[int] = []
        self.logprobs: list[float] = []

    def step(self, drafts: list[int]) -> list[worker_pb2.SampledToken]:
        self.step_id += 1
        step = worker_pb2.Step(step_id=self.step_id)
        if self.step_id == 1:
            step.new_requests.append(
                worker_pb2.NewRequest(
                    request_id=self.rid,
                    prompt_token_ids=PROMPT,
                    sampling=self.params,
                    block_ids=self.blocks,
                    num_scheduled_tokens=len(PROMPT),
                )
            )
        else:
            step.scheduled.append(
                worker_pb2.ScheduledRequest(
                    request_id=self.rid,
                    num_computed_tokens=self.num_computed,
                    num_scheduled_tokens=len(self.tokens) - self.num_computed + len(drafts),
                    draft_token_ids=drafts,
                )
            )
        result = self.runner.execute(step)
        assert not result.error and all(s.request_id == self.rid for s in result.sampled)
        assert 1 <= len(result.sampled) <= len(drafts) + 1
        new = [s.token_id for s in result.sampled]
        # What was kept of the drafts is a prefix of them, and the last token is the worker's own.
        assert new[:-1] == drafts[: len(new) - 1]
        self.tokens += new
        self.gained += new
        self.logprobs += [s.logprob for s in result.sampled]
        self.num_computed = len(self.tokens) - 1
        return list(result.sampled)

    def run(self, propose: Callable[[OneRequest], list[int]]) -> list[int]:
        self.step([])
        while len(self.gained) < MAX_NEW:
            room = MAX_NEW - len(self.gained) - 1
            self.step(propose(self)[:room])
        self.runner.execute(worker_pb2.Step(step_id=self.step_id + 1, removed_request_ids=[self.rid]))
        return self.gained[:MAX_NEW]


def test_right_drafts_are_kept_whole(runner: ModelRunner, reference: list[int]) -> None:
    req = OneRequest(runner, "right")
    steps_before = req.step_id
    out = req.run(lambda r: reference[len(r.gained) : len(r.gained) + 5])
    assert out == reference
    # 1 prefill token, then 6 tokens per verified step.
    assert req.step_id - steps_before <= 1 + -(-(MAX_NEW - 1) // 6)


def test_wrong_drafts_cost_nothing_but_their_rows(runner: ModelRunner, reference: list[int]) -> None:
    req = OneRequest(runner, "wrong")
    # Each draft differs from the true next token: only the worker's own sample is kept, every step.
    out = req.run(lambda r: [(reference[len(r.gained)] + 1) % 512, 3, 3, 3])
    assert out == reference
    assert req.step_id == MAX_NEW


def test_partly_right_drafts_leave_no_trace_of_the_rest(runner: ModelRunner, reference: list[int]) -> None:
    rng = random.Random(0)

    def propose(r: OneRequest) -> list[int]:
        # A right run of random length, then junk: the junk's KV is written and must be overwritten later.
        good = reference[len(r.gained) : len(r.gained) + rng.randint(0, 4)]
        return good + [rng.randrange(512) for _ in range(rng.randint(0, 4))]

    assert OneRequest(runner, "partly").run(propose) == reference


def test_penalties_and_logprobs_see_the_drafts_as_history(runner: ModelRunner) -> None:
    params = sampling_pb2.SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, logprobs=True)
    plain = OneRequest(runner, "plain-pen", params)
    expected = plain.run(lambda r: [])
    # Drafts taken from the plain run: right ones are kept only if the penalised sample agrees at each position.
    spec = OneRequest(runner, "spec-pen", params)
    assert spec.run(lambda r: expected[len(r.gained) : len(r.gained) + 4]) == expected
    assert spec.step_id < plain.step_id
    assert spec.logprobs[:MAX_NEW] == pytest.approx(plain.logprobs[:MAX_NEW], abs=1e-4)


def _rejected(runner: ModelRunner, drafts: list[int], params: sampling_pb2.SamplingParams, extra: int = 0) -> str:
    rid = f"bad-{len(runner.batch)}-{random.random()}"
    first = worker_pb2.Step(
        step_id=1,
        new_requests=[
            worker_pb2.NewRequest(
                request_id=rid, prompt_token_ids=PROMPT, sampling=params, block_ids=list(range(16)),
                num_scheduled_tokens=len(PROMPT),
            )
        ],
    )  # fmt: skip
    runner.execute(first)
    held = runner.batch.get(rid)
    before = (list(held.token_ids), held.num_computed_tokens)
    step = worker_pb2.Step(
        step_id=2,
        scheduled=[
            worker_pb2.ScheduledRequest(
                request_id=rid, num_computed_tokens=len(PROMPT),
                num_scheduled_tokens=1 + len(drafts) + extra, draft_token_ids=drafts,
            )
        ],
    )  # fmt: skip
    with pytest.raises(ValueError) as info:
        runner.execute(step)
    # Refused before anything ran: the request is as it was.
    assert (list(held.token_ids), held.num_computed_tokens) == before
    runner.execute(worker_pb2.Step(step_id=3, removed_request_ids=[rid]))
    return str(info.value)


def test_drafts_outside_the_rules_are_refused_naming_the_request(runner: ModelRunner) -> None:
    sampled = sampling_pb2.SamplingParams(temperature=0.7)
    assert "not greedy" in _rejected(runner, [1, 2], sampled)
    grammar = sampling_pb2.SamplingParams(temperature=0, grammar=sampling_pb2.Grammar(regex="[ab]+"))
    assert "has a grammar" in _rejected(runner, [1, 2], grammar)
    assert f"at most {MAX_DRAFT_TOKENS}" in _rejected(runner, [1] * (MAX_DRAFT_TOKENS + 1), GREEDY)
    assert "draft token id 512 outside" in _rejected(runner, [1, 512], GREEDY)
    assert "must follow all of its" in _rejected(runner, [1, 2], GREEDY, extra=-1)
