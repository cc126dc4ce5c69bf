"""Which worker's queue a request joins: a small pure policy over each candidate's cache and load.

`kv` (the default) works like Dynamo's KV router and SGLang's cache-aware router: the cost of a worker is
the prompt tokens it would have to compute (those not already in its prefix cache, or about to be from a
request queued there; a prefix held by the kvstore is cheap on every worker that has one) plus the tokens
it already has to get through. Repeated prefixes therefore stick to the worker holding them; a load cap
keeps a popular prefix from herding every request onto one worker; ties go round-robin so unrelated
traffic spreads.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class RoutingPolicy(enum.StrEnum):
    """--routing."""

    KV = "kv"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


# A running request makes every one of the worker's steps longer; counted as this many prompt tokens of
# work, so a worker busy decoding is not mistaken for an idle one with a cold cache.
DECODE_TOKENS_PER_RUNNING = 16
# Loading a stored block costs this fraction of computing it (a copy from the kvstore against a forward pass;
# on a CPU the store's Get runs at several GB/s, a prefill at a few thousand tokens per second).
STORED_TOKEN_COST = 0.1
# A worker may hold this many more requests than the least-loaded candidate before the router stops
# sending it requests for their cached prefix (SGLang's balance threshold idea).
LOAD_CAP_REQUESTS = 8
# ... or this factor more, whichever is larger, so the cap grows with the traffic.
LOAD_CAP_FACTOR = 2.0


@dataclass(frozen=True)
class Candidate:
    """One ready worker as the router sees it for one request."""

    worker_id: str
    # Prompt tokens of this request found in the worker's cache (or in prompts queued there).
    cached_tokens: int
    # Tokens its queued requests, and its running ones still in their prefill, have to compute.
    queued_tokens: int
    num_waiting: int
    num_running: int
    # KV blocks free now, and the blocks this request would need beyond its cached prefix.
    free_blocks: int
    needed_blocks: int
    block_size: int
    # Tokens beyond cached_tokens the worker can load from the kvstore instead of computing.
    stored_tokens: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_waiting + self.num_running


def kv_cost(candidate: Candidate, prompt_tokens: int) -> int:
    """Tokens of work before this request's first token on this worker."""
    uncached = prompt_tokens - candidate.cached_tokens - candidate.stored_tokens
    uncached += int(candidate.stored_tokens * STORED_TOKEN_COST)
    load = candidate.queued_tokens + DECODE_TOKENS_PER_RUNNING * candidate.num_running
    # Without room for its blocks the request waits for others to finish (or preempts one).
    shortage = max(0, candidate.needed_blocks - candidate.free_blocks) * candidate.block_size
    return uncached + load + shortage


def within_load_cap(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates not overloaded compared with the least-loaded one (never empty)."""
    least = min(c.num_requests for c in candidates)
    cap = max(least + LOAD_CAP_REQUESTS, int(least * LOAD_CAP_FACTOR))
    return [c for c in candidates if c.num_requests <= cap]


def choose_worker(policy: RoutingPolicy, candidates: Sequence[Candidate], prompt_tokens: int, turn: int) -> str:
    """The worker_id a request goes to. `turn` is a counter the caller increments per routed request;
    it drives round-robin and breaks ties, so equal workers take turns rather than the first one winning."""
    if not candidates:
        raise ValueError("no candidate worker")
    ordered = sorted(candidates, key=lambda c: c.worker_id)
    n = len(ordered)
    # Rotate by the turn so that among equals the pick moves along.
    rotated = [ordered[(turn + i) % n] for i in range(n)]
    if policy is RoutingPolicy.ROUND_ROBIN:
        return rotated[0].worker_id
    if policy is RoutingPolicy.LEAST_LOADED:
        return min(rotated, key=lambda c: (c.num_requests, c.queued_tokens)).worker_id
    allowed = within_load_cap(rotated)
    return min(allowed, key=lambda c: (kv_cost(c, prompt_tokens), c.num_requests)).worker_id
