"""FIFO of requests waiting for a worker, shared by every worker's scheduler."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from services.scheduler.request import Request


class WaitingQueue:
    """Requests in admission order; preempted ones go back to the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def append(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_many(self, requests: Iterable[Request]) -> None:
        """Put requests at the head, keeping their order (for a drained worker's requests)."""
        self._queue.extendleft(reversed(list(requests)))

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def popleft(self) -> Request:
        return self._queue.popleft()

    def remove(self, request_id: str) -> Request | None:
        """Take the request with this id out of the queue; None when it is not queued."""
        for request in self._queue:
            if request.request_id == request_id:
                self._queue.remove(request)
                return request
        return None

    def __contains__(self, request_id: object) -> bool:
        return any(r.request_id == request_id for r in self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
