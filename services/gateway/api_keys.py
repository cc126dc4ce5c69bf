"""API keys: who may call the public API (gRPC metadata and HTTP headers alike).

Keys come from --api-key (repeatable) and --api-key-file (one per line, # comments). A call carries
`authorization: Bearer <key>`; the key is compared with every configured key in constant time
(hmac.compare_digest on sha256 digests, so neither the length nor the position of a mismatch leaks),
and is never logged: what identifies a caller downstream (rate limits, logs) is `key_id`, a short hash.
Health, reflection and /metrics stay open.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

import grpc

from services.common.errors import StatusError, make_status

_BEARER = "bearer "
# A header longer than this is refused before hashing: no key is that long.
MAX_AUTHORIZATION_CHARS = 4096


def key_id(key: str) -> str:
    """A stable, non-reversible name for a key (logs and rate-limit buckets)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def read_key_file(path: Path) -> list[str]:
    """Keys of an --api-key-file: one per line, blank lines and # comments skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


class ApiKeys:
    """The configured keys; empty means the API is open."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in dict.fromkeys(keys) if k]

    @property
    def enabled(self) -> bool:
        """Whether calls must present a key."""
        return bool(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """The caller's key_id, or None when keys are off; StatusError(UNAUTHENTICATED) for a missing or wrong key."""
        if not self._digests:
            return None
        if not authorization:
            raise _unauthenticated("no API key was sent; send the header `authorization: Bearer <key>`")
        if len(authorization) > MAX_AUTHORIZATION_CHARS or not authorization[: len(_BEARER)].lower() == _BEARER:
            raise _unauthenticated("the authorization header must be `Bearer <key>`")
        key = authorization[len(_BEARER) :].strip()
        digest = hashlib.sha256(key.encode()).digest()
        # Compare against every key, whatever matched, so the time taken says nothing about which.
        matched = False
        for candidate in self._digests:
            matched |= hmac.compare_digest(digest, candidate)
        if not matched:
            raise _unauthenticated("the API key is not valid; check --api-key on the gateway")
        return key_id(key)


def _unauthenticated(message: str) -> StatusError:
    return StatusError(make_status(grpc.StatusCode.UNAUTHENTICATED, message))
