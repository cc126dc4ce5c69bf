"""Admission control: how many requests the gateway, and each client, may run at once.

A client is the host of the call's peer address (context.peer()), not an `x-client-id` header: a
header is whatever the client says, so a client that floods could send a fresh one per call and
never meet its cap, while its address it cannot choose. The cost is that clients behind one proxy
or NAT share a budget, which is why the per-client cap is off unless asked for.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass


def client_key(peer: str) -> str:
    """The host part of a grpc peer string: "ipv4:10.0.0.1:5000" -> "ipv4:10.0.0.1", "ipv6:[::1]:5" -> "ipv6:[::1]".

    Unix-socket peers have no port and are returned whole.
    """
    scheme, sep, rest = peer.partition(":")
    if not sep or scheme not in ("ipv4", "ipv6"):
        return peer
    host, colon, port = rest.rpartition(":")
    return f"{scheme}:{host}" if colon and port.isdigit() else peer


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted; the caller answers RESOURCE_EXHAUSTED with RetryInfo."""

    message: str
    retry_after: float


class Admission:
    """Counts running requests against a total cap and an optional per-client cap (0: none)."""

    def __init__(self, max_total: int, max_per_client: int, retry_after: float) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.retry_after = retry_after
        self._per_client: Counter[str] = Counter()
        self._total = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet released."""
        return self._total

    def try_acquire(self, client: str) -> Refusal | None:
        """Take a slot for one request of `client`, or say why not (then nothing was taken)."""
        if self._total >= self.max_total:
            return Refusal(
                f"the gateway is running its maximum of {self.max_total} requests "
                "(--max-concurrent-requests); retry later",
                self.retry_after,
            )
        if self.max_per_client and self._per_client[client] >= self.max_per_client:
            return Refusal(
                f"this client is running its maximum of {self.max_per_client} requests "
                "(--max-concurrent-requests-per-client); retry later",
                self.retry_after,
            )
        self._total += 1
        self._per_client[client] += 1
        self._idle.clear()
        return None

    def release(self, client: str) -> None:
        """Give back a slot taken by try_acquire."""
        self._total -= 1
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]  # the counter must not grow with every client ever seen
        if self._total == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request holds a slot."""
        await self._idle.wait()
