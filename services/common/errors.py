"""Canonical gRPC errors with google.rpc details (BadRequest field violations)."""

from __future__ import annotations

from typing import NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.common.proto.meshserve.v1.scheduler_pb2 import RequestError

_DETAILS_KEY = "grpc-status-details-bin"
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def invalid_argument_status(field: str, description: str) -> grpc.Status:
    """INVALID_ARGUMENT naming the field, with a BadRequest detail clients can read."""
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.BadRequest(
            field_violations=[error_details_pb2.BadRequest.FieldViolation(field=field, description=description)]
        )
    )
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=f"{field}: {description}", details=[detail])
    return rpc_status.to_status(status)


async def abort_invalid_argument(context: grpc.aio.ServicerContext, field: str, description: str) -> NoReturn:
    """Fail the call with INVALID_ARGUMENT for one bad field."""
    await context.abort_with_status(invalid_argument_status(field, description))
    raise AssertionError("abort_with_status returned")  # pragma: no cover - abort always raises


async def abort_with_request_error(context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
    """Fail the call with a status the scheduler reported for one request (the field too, if it named one)."""
    if error.field:
        await abort_invalid_argument(context, error.field, error.description)
    code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    await context.abort(code, error.message)
    raise AssertionError("abort returned")  # pragma: no cover - abort always raises


def field_violations(error: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    """The (field, description) pairs of a BadRequest detail in a received error."""
    out: list[tuple[str, str]] = []
    for key, value in error.trailing_metadata() or ():
        if key != _DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad):
                out.extend((v.field, v.description) for v in bad.field_violations)
    return out
