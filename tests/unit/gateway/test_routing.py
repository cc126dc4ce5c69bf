"""routing.choose: sticky on the prompt prefix, least loaded past the slack, stable across gateways."""

from __future__ import annotations

import random

from services.gateway.routing import ROUTING_PREFIX_TOKENS, Candidate, choose, prefix_key, rendezvous_score

NAMES = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]


def _idle(names: list[str] = NAMES) -> list[Candidate]:
    return [Candidate(n, 0) for n in names]


def test_no_candidates() -> None:
    assert choose([], prefix_key([1, 2, 3]), load_slack=4) is None


def test_prefix_key_uses_only_the_first_tokens() -> None:
    base = list(range(ROUTING_PREFIX_TOKENS))
    assert prefix_key([*base, 1, 2]) == prefix_key([*base, 3]) == prefix_key(base)
    assert prefix_key([*base[:-1], 999]) != prefix_key(base)
    assert prefix_key([1, 2]) != prefix_key([1, 2, 0]), "a short prompt is not padded into another"
    assert prefix_key([1]) == (1).to_bytes(4, "little")


def test_same_prefix_same_scheduler_and_spread_over_all() -> None:
    rng = random.Random(0)
    picks = []
    for _ in range(300):
        prefix = [rng.randrange(50_000) for _ in range(ROUTING_PREFIX_TOKENS)]
        first = choose(_idle(), prefix_key([*prefix, 1]), load_slack=4)
        assert first == choose(_idle(), prefix_key([*prefix, 2, 3]), load_slack=4)
        picks.append(first)
    counts = [picks.count(i) for i in range(len(NAMES))]
    assert all(c > 50 for c in counts), counts  # 100 each expected


def test_independent_of_candidate_order() -> None:
    key = prefix_key([5, 6, 7])
    forward = NAMES[choose(_idle(), key, 4)]  # type: ignore[index]
    backward = list(reversed(NAMES))
    assert backward[choose(_idle(backward), key, 4)] == forward  # type: ignore[index]


def test_only_the_prefixes_of_a_lost_scheduler_move() -> None:
    rng = random.Random(1)
    keys = [prefix_key([rng.randrange(50_000) for _ in range(8)]) for _ in range(200)]
    before = {k: NAMES[choose(_idle(), k, 4)] for k in keys}  # type: ignore[index]
    survivors = NAMES[:2]
    for k in keys:
        after = survivors[choose(_idle(survivors), k, 4)]  # type: ignore[index]
        if before[k] != NAMES[2]:
            assert after == before[k]


def test_overloaded_preferred_gives_way_to_least_loaded() -> None:
    key = prefix_key([42] * 10)
    preferred = choose(_idle(), key, load_slack=4)
    assert preferred is not None
    loads = [10, 10, 10]
    loads[preferred] = 14  # exactly the slack above the least loaded: still sticky
    assert choose([Candidate(n, load) for n, load in zip(NAMES, loads, strict=True)], key, 4) == preferred
    loads[preferred] = 15
    least = (preferred + 1) % 3
    loads[least] = 3
    assert choose([Candidate(n, load) for n, load in zip(NAMES, loads, strict=True)], key, 4) == least


def test_least_loaded_ties_break_by_score() -> None:
    key = prefix_key([7])
    scores = [rendezvous_score(n, key) for n in NAMES]
    preferred = scores.index(max(scores))
    loads = [0, 0, 0]
    loads[preferred] = 100
    others = [i for i in range(3) if i != preferred]
    expected = max(others, key=lambda i: scores[i])
    assert choose([Candidate(n, load) for n, load in zip(NAMES, loads, strict=True)], key, 4) == expected
