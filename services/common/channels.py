"""Client channels with the same limits and keepalive as our servers, and the service's TLS and token.

Every channel one meshserve service opens to another goes through open_channel (open_sync_channel for
the worker's kvstore threads): TLS with the service's own certificate as client certificate when
--tls-ca is given, insecure otherwise; the internal token on every call when --internal-token-file is.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.internal_auth import SyncTokenInterceptor, aio_token_interceptors
from services.common.settings import ServiceSettings
from services.common.tls import Security, load_security

ChannelOption = tuple[str, int | str]


def _security(security: Security | ServiceSettings | None) -> Security | None:
    return load_security(security) if isinstance(security, ServiceSettings) else security


def open_channel(
    target: str,
    security: Security | ServiceSettings | None = None,
    options: Sequence[ChannelOption] = CHANNEL_OPTIONS,
) -> grpc.aio.Channel:
    """An asyncio channel to another meshserve service (security: its settings, or their loaded Security)."""
    sec = _security(security)
    if sec is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    interceptors = aio_token_interceptors(sec.token) if sec.token is not None else None
    credentials = sec.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(
        target, credentials, options=[*options, *sec.channel_options()], interceptors=interceptors
    )


def open_sync_channel(
    target: str,
    security: Security | ServiceSettings | None = None,
    options: Sequence[ChannelOption] = CHANNEL_OPTIONS,
) -> grpc.Channel:
    """A synchronous channel (for threads outside the event loop), with the same security as open_channel."""
    sec = _security(security)
    if sec is None:
        return grpc.insecure_channel(target, options=list(options))
    credentials = sec.channel_credentials()
    if credentials is None:
        channel = grpc.insecure_channel(target, options=list(options))
    else:
        channel = grpc.secure_channel(target, credentials, options=[*options, *sec.channel_options()])
    return channel if sec.token is None else grpc.intercept_channel(channel, SyncTokenInterceptor(sec.token))


def insecure_channel(target: str) -> grpc.aio.Channel:
    """An asyncio channel to another meshserve service, without TLS or token."""
    return open_channel(target)
