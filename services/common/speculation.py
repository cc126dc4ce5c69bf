"""Speculative decoding's rules, shared by the scheduler (which proposes drafts: it holds every request's
tokens) and the worker (which verifies them and refuses a step whose drafts break these rules): which requests
may be speculated, how many draft tokens a step may carry, and which drafts a verified step keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.proto.meshserve.v1 import sampling_pb2
from services.common.sampling_checks import is_greedy

# Most draft tokens one request carries in one step: ScheduledRequest.draft_token_ids' cap on every hop.
# vLLM's ngram examples use 2-5; past ~8 a draft is rarely accepted whole, and each one costs a row of compute.
MAX_DRAFT_TOKENS = 16


def can_speculate(params: sampling_pb2.SamplingParams) -> bool:
    """Whether a request's drafts can be verified exactly: greedy, so the verified token at each position is
    the one plain decoding picks; without a grammar, whose matcher advances one accepted token at a time.

    Penalties, logit_bias, min_tokens and logprobs are kept exact by the worker, which samples each draft
    position with the history up to it."""
    return is_greedy(params) and not params.HasField("grammar")


def accepted_length(draft_token_ids: Sequence[int], sampled: Sequence[int]) -> int:
    """Tokens a speculated request gains from its verified step: the drafts whose position's sample confirms
    them, then the sample after the last confirmed one.

    sampled[j] is the token sampled after the known tokens and draft_token_ids[:j] (len(drafts) + 1 of them),
    so the tokens gained, sampled[:n], are exactly what decoding one token per step would have produced."""
    n = 1
    while n <= len(draft_token_ids) and sampled[n - 1] == draft_token_ids[n - 1]:
        n += 1
    return n
