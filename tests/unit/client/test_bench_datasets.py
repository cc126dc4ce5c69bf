"""Benchmark workloads: random, shared-prefix, JSONL and multi-turn."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from services.client.bench.datasets import (
    FIRST_ORDINARY_ID,
    BenchRequest,
    flatten,
    jsonl_dataset,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
    single_turns,
    total_output_tokens,
    turn_indices,
)


class StubEncoder:
    """Ids from characters, so token counts are predictable; chat adds two markers per message."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [1, *self.encode(m["role"] + ":" + m["content"]), 2]
        return ids


def test_random_lengths_and_ids_within_bounds() -> None:
    requests = random_dataset(200, (5, 40), (4, 16), vocab_size=512, seed=1)
    assert len(requests) == 200
    assert all(5 <= len(r.prompt_token_ids) <= 40 for r in requests)
    assert all(4 <= r.output_len <= 16 for r in requests)
    assert all(FIRST_ORDINARY_ID <= t < 512 for r in requests for t in r.prompt_token_ids)
    # The range is actually used, not just its ends.
    assert len({len(r.prompt_token_ids) for r in requests}) > 10
    assert total_output_tokens(requests) == sum(r.output_len for r in requests)


def test_random_is_seeded_and_fixed_lengths_work() -> None:
    assert random_dataset(5, (8, 8), (3, 3), 300, seed=4) == random_dataset(5, (8, 8), (3, 3), 300, seed=4)
    assert random_dataset(5, (8, 8), (3, 3), 300, seed=4) != random_dataset(5, (8, 8), (3, 3), 300, seed=5)
    assert {(len(r.prompt_token_ids), r.output_len) for r in random_dataset(5, (8, 8), (3, 3), 300)} == {(8, 3)}


@pytest.mark.parametrize("bounds", [(0, 4), (5, 4)])
def test_random_rejects_bad_ranges(bounds: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        random_dataset(2, bounds, (1, 1), 512)


def test_shared_prefix_is_identical_and_suffixes_differ() -> None:
    requests = shared_prefix_dataset(10, 64, (3, 9), (2, 5), vocab_size=512, seed=2)
    prefix = requests[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == prefix for r in requests)
    assert all(3 <= len(r.prompt_token_ids) - 64 <= 9 for r in requests)
    assert all(2 <= r.output_len <= 5 for r in requests)
    assert len({tuple(r.prompt_token_ids[64:]) for r in requests}) == 10


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_jsonl_prompt_and_messages(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "w.jsonl",
        [
            {"prompt": "abc"},
            "",
            {"messages": [{"role": "user", "content": "hi"}], "output_len": 7},
            {"prompt": "xy", "output_len": 2},
        ],
    )
    requests = jsonl_dataset(path, StubEncoder(), default_output_len=5)
    assert [r.prompt_token_ids for r in requests] == [
        [97, 98, 99],
        [1, *(ord(c) for c in "user:hi"), 2],
        [120, 121],
    ]
    assert [r.output_len for r in requests] == [5, 7, 2]
    assert len(jsonl_dataset(path, StubEncoder(), 5, num_prompts=2)) == 2


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["{not json"], "not JSON"),
        ([{"text": "x"}], "needs a 'prompt' or 'messages'"),
        ([{"prompt": "x", "output_len": 0}], "output_len must be >= 1"),
        ([""], "holds no prompts"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, lines: list[object], message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        jsonl_dataset(path, StubEncoder(), 5)


def test_multi_turn_prompts_grow_by_reply_and_user_turn() -> None:
    conversations = multi_turn_dataset(5, 4, (10, 20), (3, 6), vocab_size=512, seed=3)
    assert [len(c) for c in conversations] == [4] * 5
    for turns in conversations:
        assert 10 <= len(turns[0].prompt_token_ids) <= 20
        for earlier, later in itertools.pairwise(turns):
            # The next prompt is this prompt, a synthetic reply of this turn's output length, and a new user turn.
            assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
            added = len(later.prompt_token_ids) - len(earlier.prompt_token_ids)
            assert earlier.output_len + 10 <= added <= earlier.output_len + 20
        # Every earlier prompt is a prefix of every later one, not just of the next.
        last = turns[-1].prompt_token_ids
        assert all(last[: len(t.prompt_token_ids)] == t.prompt_token_ids for t in turns)
        assert all(3 <= t.output_len <= 6 for t in turns)
    assert all(FIRST_ORDINARY_ID <= t < 512 for c in conversations for r in c for t in r.prompt_token_ids)
    # Conversations do not share a history (a cache hit across them would be luck, not routing).
    assert len({tuple(c[0].prompt_token_ids[:8]) for c in conversations}) == 5


def test_multi_turn_is_deterministic_per_seed() -> None:
    def make(seed: int) -> list[list[BenchRequest]]:
        return multi_turn_dataset(3, 3, (8, 8), (4, 4), vocab_size=300, seed=seed)

    assert make(7) == make(7)
    assert make(7) != make(8)
    # Fixed lengths give exact sizes: turn k holds k (user + reply) pairs, then its own user turn.
    assert [len(r.prompt_token_ids) for r in make(7)[0]] == [8, 20, 32]


def test_multi_turn_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError):
        multi_turn_dataset(2, 2, (0, 4), (1, 1), 512)
    with pytest.raises(ValueError):
        multi_turn_dataset(-1, 2, (1, 4), (1, 1), 512)


def test_single_turns_flatten_and_turn_indices() -> None:
    requests = random_dataset(3, (4, 4), (2, 2), 300)
    assert single_turns(requests) == [[r] for r in requests]
    assert flatten(single_turns(requests)) == requests
    conversations = multi_turn_dataset(2, 3, (4, 4), (2, 2), 300)
    assert flatten(conversations) == conversations[0] + conversations[1]
    assert turn_indices(conversations) == [0, 1, 2, 0, 1, 2]
    assert turn_indices(single_turns(requests)) == [0, 0, 0]


def test_multi_turn_opening_turn_may_be_longer() -> None:
    [turns] = multi_turn_dataset(1, 3, (5, 5), (2, 2), vocab_size=300, seed=1, first_turn_input_len=(100, 100))
    assert [len(t.prompt_token_ids) for t in turns] == [100, 100 + 2 + 5, 100 + 2 + 5 + 2 + 5]
