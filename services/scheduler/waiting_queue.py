"""FIFO of requests waiting for one worker (each worker has its own; the router fills them)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from services.scheduler.request import Request


class WaitingQueue:
    """Requests in admission order; preempted ones go back to the head.

    Keeps the total of its requests' work (tokens to compute, as the router estimated them when it queued
    each; all their tokens otherwise), so routing does not walk every queue for every request.
    """

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self._work: dict[str, int] = {}
        self.num_tokens = 0

    def append(self, request: Request, work: int | None = None) -> None:
        self._queue.append(request)
        self._add_work(request, work)

    def prepend(self, request: Request, work: int | None = None) -> None:
        self._queue.appendleft(request)
        self._add_work(request, work)

    def _add_work(self, request: Request, work: int | None) -> None:
        tokens = request.num_tokens if work is None else work
        self._work[request.request_id] = tokens
        self.num_tokens += tokens

    def _drop_work(self, request: Request) -> None:
        self.num_tokens -= self._work.pop(request.request_id, 0)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def popleft(self) -> Request:
        request = self._queue.popleft()
        self._drop_work(request)
        return request

    def remove(self, request_id: str) -> Request | None:
        """Take the request with this id out of the queue; None when it is not queued."""
        for request in self._queue:
            if request.request_id == request_id:
                self._queue.remove(request)
                self._drop_work(request)
                return request
        return None

    def take_all(self) -> list[Request]:
        """Empty the queue, returning its requests in order."""
        out = list(self._queue)
        self._queue.clear()
        self._work.clear()
        self.num_tokens = 0
        return out

    def __contains__(self, request_id: object) -> bool:
        return any(r.request_id == request_id for r in self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
