"""Free ports come from below the kernel's ephemeral range, where no outgoing connection can take them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.common import ports
from services.common.ports import DEFAULT_EPHEMERAL_RANGE, FIRST_FREE_PORT, ephemeral_range, free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    low, _ = ephemeral_range()
    port = free_port()
    if low > FIRST_FREE_PORT:
        assert FIRST_FREE_PORT <= port < low
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        # Every random try hits the busy port: the kernel's own pick (port 0) is the fallback.
        monkeypatch.setattr(ports.random, "sample", lambda population, k: [busy] * k)
        port = free_port(ephemeral=(max(busy, FIRST_FREE_PORT) + 1, 65535))
        assert port != busy


def test_a_port_handed_out_but_not_yet_bound_is_never_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # A launcher picks the scheduler's, each worker's and the gateway's ports before any of them binds: every
    # try proposing the first pick again must still give a second, different port.
    first = free_port()
    low = max(first, FIRST_FREE_PORT) + 1
    monkeypatch.setattr(ports.random, "sample", lambda population, k: [first] * k)
    second = free_port(ephemeral=(low, 65535))
    assert second != first
    third = free_port(ephemeral=(low, 65535))
    assert third not in (first, second)


def test_no_room_below_the_range_falls_back_to_the_kernels_pick() -> None:
    port = free_port(ephemeral=(FIRST_FREE_PORT - 1000, 65535))
    assert 0 < port <= 65535


def test_the_range_is_read_from_the_kernel_or_defaulted(tmp_path: Path) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(path) == (40000, 50000)
    path.write_text("garbage\n")
    assert ephemeral_range(path) == DEFAULT_EPHEMERAL_RANGE
    assert ephemeral_range(tmp_path / "missing") == DEFAULT_EPHEMERAL_RANGE
