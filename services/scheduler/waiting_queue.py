"""FIFO of requests waiting for one worker (each worker has its own; the router fills them)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from services.scheduler.request import Request


class WaitingQueue:
    """Requests in admission order; preempted ones go back to the head.

    Keeps the total of its requests' uncomputed tokens, the router's measure of queued work, so routing
    does not walk every queue for every request.
    """

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self.num_tokens = 0

    def append(self, request: Request) -> None:
        self._queue.append(request)
        self.num_tokens += request.num_tokens

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)
        self.num_tokens += request.num_tokens

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def popleft(self) -> Request:
        request = self._queue.popleft()
        self.num_tokens -= request.num_tokens
        return request

    def remove(self, request_id: str) -> Request | None:
        """Take the request with this id out of the queue; None when it is not queued."""
        for request in self._queue:
            if request.request_id == request_id:
                self._queue.remove(request)
                self.num_tokens -= request.num_tokens
                return request
        return None

    def take_all(self) -> list[Request]:
        """Empty the queue, returning its requests in order."""
        out = list(self._queue)
        self._queue.clear()
        self.num_tokens = 0
        return out

    def __contains__(self, request_id: object) -> bool:
        return any(r.request_id == request_id for r in self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
