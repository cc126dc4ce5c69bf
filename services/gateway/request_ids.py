"""A request's two ids: the one its client chose (checked, echoed, logged) and the gateway's own.

A client's id is not unique (two clients, or one client's retries, may send the same), so it never
keys anything: the scheduler sees a fresh id per request, and the gateway logs both side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.proto.meshserve.v1 import generation_pb2
from services.common.request_context import METADATA_KEY, check_request_id, new_request_id, request_id_from_metadata


@dataclass(frozen=True)
class RequestIds:
    """`internal`: fresh per request, the scheduler's key and the gateway's log request_id. `client`: the
    client's own id (GenerateRequest.request_id, else x-request-id), if it sent one."""

    internal: str
    client: str | None

    @property
    def public(self) -> str:
        """What the first response echoes: the client's id, else the one the gateway made."""
        return self.client or self.internal


def request_ids(request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> RequestIds:
    """Check the client's ids (raising InvalidField naming request_id or x-request-id) and make the internal one."""
    from_metadata = request_id_from_metadata(context) or None
    if from_metadata is not None:
        check_request_id(from_metadata, METADATA_KEY)
    from_request = request.request_id or None  # read once: each read of a string field copies it
    if from_request is not None:
        check_request_id(from_request, "request_id")
    return RequestIds(new_request_id(), from_request or from_metadata)
