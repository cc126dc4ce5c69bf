"""Which scheduler a new request goes to: sticky on its prompt prefix, unless that one is overloaded.

Each scheduler keeps its own prefix cache, so prompts that share a prefix (a system prompt, a
conversation so far) are worth sending to the same one. Rendezvous (highest-random-weight) hashing
of the first ROUTING_PREFIX_TOKENS prompt tokens gives that without shared state between gateways,
and when a scheduler leaves or joins only the prefixes that hashed to it move.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

# How much of the prompt decides stickiness: long enough to tell conversations apart beyond a chat
# template's opening tokens, short enough that prompts sharing a system prompt still meet.
ROUTING_PREFIX_TOKENS = 64


@dataclass(frozen=True)
class Candidate:
    """One healthy scheduler: its address (the hash identity) and its load in requests."""

    name: str
    load: int


def prefix_key(prompt_token_ids: Sequence[int]) -> bytes:
    """The bytes that decide stickiness: the first ROUTING_PREFIX_TOKENS ids, int32 little-endian."""
    ids = prompt_token_ids[:ROUTING_PREFIX_TOKENS]
    return struct.pack(f"<{len(ids)}i", *ids)


def rendezvous_score(name: str, key: bytes) -> int:
    """A stable pseudo-random weight of (scheduler, prefix); the highest one wins the prefix."""
    # NUL never occurs in a host:port, so (name, key) pairs cannot run into each other.
    digest = hashlib.blake2b(name.encode() + b"\0" + key, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def choose(candidates: Sequence[Candidate], key: bytes, load_slack: int) -> int | None:
    """Index of the scheduler for a request with this prefix key, or None when there is none.

    The prefix's rendezvous winner, unless its load exceeds the least loaded one's by more than
    load_slack: then the least loaded (ties broken by score, so every gateway picks the same one).
    """
    if not candidates:
        return None
    scores = [rendezvous_score(c.name, key) for c in candidates]
    preferred = max(range(len(candidates)), key=lambda i: scores[i])
    least = min(range(len(candidates)), key=lambda i: (candidates[i].load, -scores[i]))
    if candidates[preferred].load - candidates[least].load > load_slack:
        return least
    return preferred
