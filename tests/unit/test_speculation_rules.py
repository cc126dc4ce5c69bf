"""services/common/speculation.py: which requests may be speculated and which drafts a verified step keeps."""

import pytest

from services.common.proto.meshserve.v1 import sampling_pb2
from services.common.speculation import accepted_length, can_speculate


@pytest.mark.parametrize(
    ("drafts", "sampled", "kept"),
    [
        ([], [7], 1),  # no drafts: the one sample
        ([5, 6, 7], [9, 6, 7, 8], 1),  # the first draft is wrong: only the sample that replaces it
        ([5, 6, 7], [5, 6, 9, 8], 3),  # two confirmed, then the sample at the third position
        ([5, 6, 7], [5, 6, 7, 8], 4),  # all confirmed, and the sample after them
        ([5, 6, 7], [5, 9, 7, 8], 2),  # a later match after a miss does not count
    ],
)
def test_a_verified_step_keeps_the_confirmed_drafts_and_one_sample(
    drafts: list[int], sampled: list[int], kept: int
) -> None:
    assert accepted_length(drafts, sampled) == kept


def test_only_greedy_requests_without_a_grammar_are_speculated() -> None:
    assert can_speculate(sampling_pb2.SamplingParams(temperature=0))
    # Penalties, bias and logprobs stay exact: the worker samples each draft position with its own history.
    assert can_speculate(
        sampling_pb2.SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=True, logit_bias={3: 1.0})
    )
    assert not can_speculate(sampling_pb2.SamplingParams())  # temperature unset: 1.0
    assert not can_speculate(sampling_pb2.SamplingParams(temperature=0.7))
    grammar = sampling_pb2.Grammar(regex="[ab]+")
    assert not can_speculate(sampling_pb2.SamplingParams(temperature=0, grammar=grammar))
