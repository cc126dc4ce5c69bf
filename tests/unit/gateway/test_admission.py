"""Admission: the total and per-client caps, release, and what counts as one client."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission import Admission, client_key


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        ("ipv4:127.0.0.1:53412", "ipv4:127.0.0.1"),
        ("ipv6:[::1]:53412", "ipv6:[::1]"),
        ("ipv6:[2001:db8::7]:443", "ipv6:[2001:db8::7]"),
        ("unix:/tmp/gw.sock", "unix:/tmp/gw.sock"),
        ("unix-abstract:gw", "unix-abstract:gw"),
        ("", ""),
    ],
)
def test_client_key_is_the_peer_host(peer: str, key: str) -> None:
    assert client_key(peer) == key


def test_total_cap() -> None:
    admission = Admission(max_total=2, max_per_client=0, retry_after=1.5)
    assert admission.try_acquire("a") is None and admission.try_acquire("b") is None
    refusal = admission.try_acquire("c")
    assert refusal is not None and refusal.retry_after == 1.5
    assert "--max-concurrent-requests" in refusal.message and "retry" in refusal.message
    admission.release("a")
    assert admission.try_acquire("c") is None
    assert admission.in_flight == 2


def test_per_client_cap_leaves_other_clients_alone() -> None:
    admission = Admission(max_total=10, max_per_client=2, retry_after=1.0)
    assert admission.try_acquire("a") is None and admission.try_acquire("a") is None
    refusal = admission.try_acquire("a")
    assert refusal is not None and "--max-concurrent-requests-per-client" in refusal.message
    assert admission.try_acquire("b") is None
    admission.release("a")
    assert admission.try_acquire("a") is None
    assert admission.in_flight == 3, "a refusal takes nothing"


async def test_wait_idle_and_no_memory_of_departed_clients() -> None:
    admission = Admission(max_total=10, max_per_client=5, retry_after=1.0)
    for i in range(3):
        assert admission.try_acquire(f"client-{i}") is None
    waiter = asyncio.create_task(admission.wait_idle())
    await asyncio.sleep(0)
    assert not waiter.done()
    for i in range(3):
        admission.release(f"client-{i}")
    await asyncio.wait_for(waiter, timeout=5)
    assert not admission._per_client, "released clients are forgotten"
