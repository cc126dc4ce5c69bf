"""The routing policy: cached prefixes stick, load caps stop herding, ties rotate."""

from __future__ import annotations

import pytest

from services.scheduler.router import (
    LOAD_CAP_REQUESTS,
    Candidate,
    RoutingPolicy,
    choose_worker,
    kv_cost,
)


def cand(worker_id: str, cached: int = 0, queued: int = 0, waiting: int = 0, running: int = 0, free: int = 100,
         needed: int = 4) -> Candidate:  # fmt: skip
    return Candidate(worker_id, cached, queued, waiting, running, free, needed, block_size=16)


def test_kv_prefers_the_worker_holding_the_prefix() -> None:
    workers = [cand("a"), cand("b", cached=192, running=2)]
    for turn in range(4):
        assert choose_worker(RoutingPolicy.KV, workers, prompt_tokens=200, turn=turn) == "b"


def test_kv_spreads_unrelated_requests_between_equal_workers() -> None:
    workers = [cand("a"), cand("b")]
    picks = {choose_worker(RoutingPolicy.KV, workers, prompt_tokens=50, turn=t) for t in range(4)}
    assert picks == {"a", "b"}


def test_kv_load_cap_stops_herding_onto_the_cached_worker() -> None:
    busy = cand("hot", cached=4096, waiting=LOAD_CAP_REQUESTS + 5, queued=100)
    idle = cand("cold")
    assert choose_worker(RoutingPolicy.KV, [busy, idle], prompt_tokens=4100, turn=0) == "cold"
    # Within the cap the cache wins, even though it is busier.
    warm = cand("hot", cached=4096, waiting=LOAD_CAP_REQUESTS - 1, queued=100)
    assert choose_worker(RoutingPolicy.KV, [warm, idle], prompt_tokens=4100, turn=0) == "hot"


def test_kv_cost_counts_uncached_prompt_queue_running_and_block_shortage() -> None:
    c = cand("a", cached=32, queued=100, running=2, free=1, needed=3)
    assert kv_cost(c, prompt_tokens=64) == (64 - 32) + 100 + 2 * 16 + 2 * 16


def test_round_robin_cycles_whatever_the_cache() -> None:
    workers = [cand("b", cached=500), cand("a")]
    assert [choose_worker(RoutingPolicy.ROUND_ROBIN, workers, 10, t) for t in range(4)] == ["a", "b", "a", "b"]


def test_least_loaded_picks_fewest_requests() -> None:
    workers = [cand("a", waiting=3), cand("b", running=1), cand("c", waiting=1, running=1)]
    assert choose_worker(RoutingPolicy.LEAST_LOADED, workers, 10, turn=0) == "b"


def test_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_worker(RoutingPolicy.KV, [], 10, 0)


def test_kv_counts_stored_prefix_as_cheap_but_local_cache_as_cheaper() -> None:
    stored = Candidate("a", 0, 0, 0, 0, 100, 4, block_size=16, stored_tokens=1024)
    cold = cand("b", queued=200)
    # A prefix the kvstore holds is worth more than an idle worker's cold cache...
    assert kv_cost(stored, 1100) < kv_cost(cold, 1100)
    assert choose_worker(RoutingPolicy.KV, [stored, cold], prompt_tokens=1100, turn=1) == "a"
    # ... but a local hit (no copy at all) wins over loading the same tokens.
    local = cand("c", cached=1024)
    assert kv_cost(local, 1100) < kv_cost(stored, 1100)
