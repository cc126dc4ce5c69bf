"""Free loopback ports for processes started on this host (tests, `meshserve up`, TP rendezvous)."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

# Where metrics are served: every container of the deploy files, and `meshserve up`'s first metrics port
# (gateway, then scheduler, kvstore and each worker on the next ones); `meshserve top` looks there.
DEFAULT_METRICS_PORT = 9400

# Ports handed out come from [FIRST_FREE_PORT, the kernel's ephemeral range): a port the kernel picks for an
# outgoing connection (or a bind to port 0) always lies inside that range, so between this check and the
# caller's own bind no connection can take the port. Handed out from the ephemeral range, it could: a worker
# once failed to start with "Address already in use" in the test suite.
FIRST_FREE_PORT = 20000
# Random tries below the ephemeral range before falling back to a port inside it.
FREE_PORT_ATTEMPTS = 100
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ip_local_port_range, where the file cannot be read.
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)

# Ports this process has handed out. A launcher picks every service's port before any of them binds, so a
# port free at the second pick may be the first pick's: nothing listens on it yet. Never handing one out
# twice closes that gap (the suite once started a worker on the scheduler's port: "Address already in use").
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for ports it picks itself (ip_local_port_range)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def free_port(host: str = "127.0.0.1", ephemeral: tuple[int, int] | None = None) -> int:
    """A port nothing listens on right now, below the kernel's ephemeral range where it leaves room."""
    low, _ = ephemeral or ephemeral_range()
    with _handed_out_lock:
        if low > FIRST_FREE_PORT:
            for port in random.sample(range(FIRST_FREE_PORT, low), min(FREE_PORT_ATTEMPTS, low - FIRST_FREE_PORT)):
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 50) -> int:
    """The first of `count` consecutive ports nothing listens on right now (for a metrics base port)."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host}")
