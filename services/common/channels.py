"""Client channels with the same limits and keepalive as our servers."""

from __future__ import annotations

import grpc

from services.common.grpc_server import CHANNEL_OPTIONS


def insecure_channel(target: str) -> grpc.aio.Channel:
    """An asyncio channel to another meshserve service."""
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
