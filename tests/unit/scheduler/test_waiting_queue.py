"""The waiting queue: its head of requests put back, and the order of the rest under each policy."""

from __future__ import annotations

import pytest

from services.common.proto.meshserve.v1 import sampling_pb2
from services.scheduler.request import Request
from services.scheduler.waiting_queue import SchedulingPolicy, WaitingQueue
from tests.support.planner import make_planner

POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "shortest-prefill-first")


def req(request_id: str, prompt_len: int = 1, arrival: float = 100.0) -> Request:
    """Distinct prompts, so no request finds another's blocks cached."""
    first = 1000 * (sum(map(ord, request_id)) % 40)
    prompt = [first + i for i in range(prompt_len)]
    return Request(request_id, prompt, sampling_pb2.SamplingParams(), [], 1, arrival_time=arrival)


def ids(queue: WaitingQueue) -> list[str]:
    return [r.request_id for r in queue]


@pytest.mark.parametrize("policy", POLICIES)
def test_put_back_requests_go_first_last_first_and_the_rest_keep_their_order(policy: SchedulingPolicy) -> None:
    q = WaitingQueue(policy)
    a, b, c = req("a", arrival=1.0), req("b", arrival=2.0), req("c", arrival=3.0)
    q.append(a)
    q.append(b)
    q.prepend(c)
    assert ids(q) == ["c", "a", "b"]
    assert q.peek() is c
    assert q.remove("a") is a
    assert q.remove("zz") is None
    assert "b" in q and "a" not in q
    assert q.popleft() is c
    assert q.num_tokens == 1
    q.prepend(a)
    q.prepend(c)
    assert ids(q) == ["c", "a", "b"]
    assert q.num_tokens == 3
    assert q.take_all() == [c, a, b]
    assert len(q) == 0 and q.num_tokens == 0 and q.peek() is None


def test_fcfs_keeps_the_append_order_whatever_the_work() -> None:
    q = WaitingQueue("fcfs")
    for request_id, length, arrival in (("long", 500, 1.0), ("short", 10, 1.0), ("late", 1, 9.0), ("mid", 50, 2.0)):
        q.append(req(request_id, length, arrival))
    assert ids(q) == ["long", "short", "late", "mid"]


def test_shortest_prefill_first_orders_requests_that_arrive_together_by_their_work() -> None:
    q = WaitingQueue("shortest-prefill-first")
    for request_id, length in (("a", 300), ("b", 40), ("c", 512), ("d", 40), ("e", 1)):
        q.append(req(request_id, length, arrival=5.0))
    # Equal work keeps the append order (b before d).
    assert ids(q) == ["e", "b", "d", "a", "c"]
    assert [q.popleft().request_id for _ in range(2)] == ["e", "b"]
    assert q.num_tokens == 40 + 300 + 512


def test_shortest_prefill_first_ranks_by_the_routers_work_estimate_not_the_prompt() -> None:
    """A long prompt whose prefix is cached costs only its uncached tokens."""
    q = WaitingQueue("shortest-prefill-first")
    q.append(req("cached", 1000), work=16)
    q.append(req("fresh", 100))
    assert ids(q) == ["cached", "fresh"]
    assert q.num_tokens == 16 + 100


def test_a_waiting_request_is_overtaken_only_by_requests_that_arrived_soon_after_it() -> None:
    """At 1,000 tokens a second, a 500-token prompt that arrived at t=0 yields to a 100-token one that arrived
    before t=0.4, and no longer to one that arrived later."""
    q = WaitingQueue("shortest-prefill-first", aging_tokens_per_s=1000.0)
    q.append(req("old-long", 500, arrival=0.0))
    q.append(req("soon-short", 100, arrival=0.3))
    q.append(req("late-short", 100, arrival=0.5))
    assert ids(q) == ["soon-short", "old-long", "late-short"]


def test_a_slower_aging_rate_lets_short_requests_overtake_for_longer() -> None:
    q = WaitingQueue("shortest-prefill-first", aging_tokens_per_s=100.0)
    q.append(req("old-long", 500, arrival=0.0))
    q.append(req("late-short", 100, arrival=3.0))
    assert ids(q) == ["late-short", "old-long"]


def test_the_aging_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="aging_tokens_per_s must be > 0"):
        WaitingQueue("shortest-prefill-first", aging_tokens_per_s=0.0)


@pytest.mark.parametrize(
    ("policy", "admitted"),
    [("shortest-prefill-first", [("s1", 20), ("s2", 30), ("long", 14)]), ("fcfs", [("long", 60), ("s1", 4)])],
)
def test_the_planner_admits_a_burst_in_the_policys_order_within_its_budget(
    policy: SchedulingPolicy, admitted: list[tuple[str, int]]
) -> None:
    """Shortest first, the first step of a burst takes the short prompts and the long one that arrived first
    starts with what is left; in arrival order the long one takes most of the step."""
    waiting = WaitingQueue(policy)
    planner = make_planner(waiting, max_num_batched_tokens=64)
    for request_id, length in (("long", 60), ("s1", 20), ("s2", 30)):
        waiting.append(req(request_id, length, arrival=1.0))
    step = planner.schedule()
    assert step is not None
    assert [(n.request_id, n.num_scheduled_tokens) for n in step.new_requests] == admitted
