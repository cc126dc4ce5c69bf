"""Free loopback ports for processes started on this host (tests, `meshserve up`, TP rendezvous)."""

from __future__ import annotations

import socket

# Where metrics are served: every container of the deploy files, and `meshserve up`'s first metrics port
# (gateway, then scheduler, kvstore and each worker on the next ones); `meshserve top` looks there.
DEFAULT_METRICS_PORT = 9400


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
