"""The requests waiting for one worker (each worker has its own; the router fills them), in policy order."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Literal

from services.scheduler.request import Request

# Which queued request a worker admits next:
# - fcfs: arrival order, as vLLM's default;
# - shortest-prefill-first: the least prefill work first, aged by queue time (see WaitingQueue).
SchedulingPolicy = Literal["fcfs", "shortest-prefill-first"]
DEFAULT_SCHEDULING_POLICY: SchedulingPolicy = "shortest-prefill-first"
# Under shortest-prefill-first, a second of waiting counts as this many prefill tokens less: a request is
# overtaken only by requests that arrived less than (its work - theirs) / rate seconds after it, so its
# delay is bounded by the later arrivals of a window no longer than its own work / rate (0.5 s for a
# 512-token prompt), and nothing starves.
DEFAULT_SCHEDULING_AGING_TOKENS_PER_S = 1000.0


class WaitingQueue:
    """Requests waiting for admission; preempted and requeued ones go back to the head.

    The head (requests put back with prepend: they were running, or a lost worker's) always goes first,
    the last put back first. The rest are ordered by the policy:
    - fcfs: in the order they were appended;
    - shortest-prefill-first: by arrival time + work / aging rate, ties in append order. Requests that arrive
      together go shortest first, which lowers the mean time to first token of a burst (a prompt's first
      token waits for every prefill admitted before it); the arrival time keeps an old request from being
      overtaken by much later short ones. A prompt's work is known at admission (unlike its output), so
      this is the shortest-job-first order over what the queue actually delays.

    Built without a policy it keeps arrival order (a queue only ever prepended to, like the cluster's parked
    one, and planners built outside a scheduler); a served worker's queue takes --scheduling-policy, whose
    default is DEFAULT_SCHEDULING_POLICY.

    Keeps the total of its requests' work (tokens to compute, as the router estimated them when it queued
    each; all their tokens otherwise), so routing does not walk every queue for every request.
    """

    def __init__(
        self,
        policy: SchedulingPolicy = "fcfs",
        aging_tokens_per_s: float = DEFAULT_SCHEDULING_AGING_TOKENS_PER_S,
    ) -> None:
        if aging_tokens_per_s <= 0:
            raise ValueError(f"aging_tokens_per_s must be > 0, got {aging_tokens_per_s}")
        self.policy: SchedulingPolicy = policy
        self._aging = aging_tokens_per_s
        self._head: deque[Request] = deque()
        # (sort key, append sequence, request), ascending; the sequence breaks ties and is never equal, so
        # requests are never compared.
        self._ordered: list[tuple[float, int, Request]] = []
        self._sequence = itertools.count()
        self._work: dict[str, int] = {}
        self.num_tokens = 0

    def append(self, request: Request, work: int | None = None) -> None:
        tokens = self._add_work(request, work)
        key = 0.0 if self.policy == "fcfs" else request.arrival_time + tokens / self._aging
        bisect.insort(self._ordered, (key, next(self._sequence), request))

    def prepend(self, request: Request, work: int | None = None) -> None:
        self._head.appendleft(request)
        self._add_work(request, work)

    def _add_work(self, request: Request, work: int | None) -> int:
        tokens = request.num_tokens if work is None else work
        self._work[request.request_id] = tokens
        self.num_tokens += tokens
        return tokens

    def _drop_work(self, request: Request) -> None:
        self.num_tokens -= self._work.pop(request.request_id, 0)

    def peek(self) -> Request | None:
        if self._head:
            return self._head[0]
        return self._ordered[0][2] if self._ordered else None

    def popleft(self) -> Request:
        request = self._head.popleft() if self._head else self._ordered.pop(0)[2]
        self._drop_work(request)
        return request

    def remove(self, request_id: str) -> Request | None:
        """Take the request with this id out of the queue; None when it is not queued."""
        for request in self._head:
            if request.request_id == request_id:
                self._head.remove(request)
                self._drop_work(request)
                return request
        for i, (_, _, request) in enumerate(self._ordered):
            if request.request_id == request_id:
                del self._ordered[i]
                self._drop_work(request)
                return request
        return None

    def take_all(self) -> list[Request]:
        """Empty the queue, returning its requests in order."""
        out = list(self)
        self._head.clear()
        self._ordered.clear()
        self._work.clear()
        self.num_tokens = 0
        return out

    def __contains__(self, request_id: object) -> bool:
        return any(r.request_id == request_id for r in self)

    def __len__(self) -> int:
        return len(self._head) + len(self._ordered)

    def __iter__(self) -> Iterator[Request]:
        """In admission order: the head, then the ordered rest."""
        yield from self._head
        for _, _, request in self._ordered:
            yield request
