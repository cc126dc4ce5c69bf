"""Benchmark workloads: the same token-id prompts and output lengths for every backend.

A workload is a list of conversations: each is a list of turns sent one after another. Single-turn
datasets (random, shared-prefix, JSONL) are lists of requests; `single_turns` makes them conversations.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias

# Low ids are special tokens in most vocabularies (BOS, EOS, chat markers); random prompts avoid them.
FIRST_ORDINARY_ID = 100


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: prompt token ids and how many tokens to generate (EOS ignored)."""

    prompt_token_ids: list[int]
    output_len: int


# Turns of one conversation, in order: turn k+1 is sent only once turn k has finished.
Conversation: TypeAlias = list[BenchRequest]


class Encoder(Protocol):
    """What the JSONL dataset needs of a tokenizer (the gateway's TextTokenizer fits)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...


def _draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"length range {lo}-{hi} must satisfy 1 <= low <= high")
    return rng.randint(lo, hi)


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)]


# Products such as 100 * 1.1 land a hair off the integer; bounds within this of one are that integer.
_RATIO_EPS = 1e-9


def ratio_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: the inclusive bounds [floor(len*(1-r)), ceil(len*(1+r))], low at least 1.

    ratio lies in [0, 1); 0 gives (length, length).
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0 <= ratio < 1:
        raise ValueError(f"range ratio must lie in [0, 1), got {ratio}")
    lo = math.floor(length * (1 - ratio) + _RATIO_EPS)
    hi = math.ceil(length * (1 + ratio) - _RATIO_EPS)
    return max(lo, 1), hi


def random_dataset(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random token prompts with lengths drawn uniformly from the given inclusive ranges."""
    rng = random.Random(seed)
    return [
        BenchRequest(_tokens(rng, _draw(rng, input_len), vocab_size), _draw(rng, output_len))
        for _ in range(num_prompts)
    ]


def shared_prefix_dataset(
    num_prompts: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """One common prefix of prefix_len tokens, then a distinct random suffix per prompt."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, vocab_size)
    return [
        BenchRequest(prefix + _tokens(rng, _draw(rng, suffix_len), vocab_size), _draw(rng, output_len))
        for _ in range(num_prompts)
    ]


def multi_turn_dataset(
    num_conversations: int,
    num_turns: int,
    turn_input_len: tuple[int, int],
    turn_output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    first_turn_input_len: tuple[int, int] | None = None,
) -> list[Conversation]:
    """Chat conversations: turn k's prompt is every earlier turn's user text and reply, then the new user text.

    The replies in the history are synthetic (random ids of the turn's output length), not what the server
    generated, so every prompt is fixed by the seed and each turn's prompt is a prefix of the next one's.
    first_turn_input_len (default turn_input_len) sizes the opening turn alone, for chats that open with a
    long document or system prompt and go on with short questions.
    """
    if num_conversations < 0 or num_turns < 0:
        raise ValueError(f"conversation and turn counts must be >= 0, got {num_conversations} and {num_turns}")
    rng = random.Random(seed)
    conversations: list[Conversation] = []
    for _ in range(num_conversations):
        history: list[int] = []
        turns: Conversation = []
        for k in range(num_turns):
            input_len = turn_input_len if k or first_turn_input_len is None else first_turn_input_len
            prompt = history + _tokens(rng, _draw(rng, input_len), vocab_size)
            output_len = _draw(rng, turn_output_len)
            turns.append(BenchRequest(prompt, output_len))
            # The reply has the length the turn asks for, as a real reply (EOS ignored) would.
            history = prompt + _tokens(rng, output_len, vocab_size)
        conversations.append(turns)
    return conversations


def single_turns(requests: Sequence[BenchRequest]) -> list[Conversation]:
    """Each request as a conversation of its own."""
    return [[request] for request in requests]


def flatten(conversations: Sequence[Sequence[BenchRequest]]) -> list[BenchRequest]:
    """Every turn, conversation by conversation: the order the runner returns records in."""
    return [turn for conversation in conversations for turn in conversation]


def turn_indices(conversations: Sequence[Sequence[BenchRequest]]) -> list[int]:
    """Each turn's position in its conversation (0 first), in flatten's order."""
    return [k for conversation in conversations for k in range(len(conversation))]


def jsonl_dataset(
    path: Path, encoder: Encoder, default_output_len: int, num_prompts: int | None = None
) -> list[BenchRequest]:
    """Lines of {"prompt": str} or {"messages": [{"role", "content"}]}, optional "output_len"."""
    requests: list[BenchRequest] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not JSON ({err.msg})") from err
        if "prompt" in record:
            ids = encoder.encode(str(record["prompt"]))
        elif "messages" in record:
            ids = encoder.encode_chat([{"role": m["role"], "content": m["content"]} for m in record["messages"]])
        else:
            raise ValueError(f"{path}:{lineno}: needs a 'prompt' or 'messages' field")
        output_len = int(record.get("output_len", default_output_len))
        if output_len < 1:
            raise ValueError(f"{path}:{lineno}: output_len must be >= 1")
        requests.append(BenchRequest(ids, output_len))
        if num_prompts is not None and len(requests) == num_prompts:
            break
    if not requests:
        raise ValueError(f"{path} holds no prompts")
    return requests


def total_output_tokens(requests: Sequence[BenchRequest]) -> int:
    """Tokens the workload asks for."""
    return sum(r.output_len for r in requests)
