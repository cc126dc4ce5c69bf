"""Canonical gRPC errors with google.rpc details (BadRequest field violations, RetryInfo, ErrorInfo).

Every status carries a google.rpc.ErrorInfo whose `reason` is a stable, documented constant (docs/api.md)
that clients may branch on; the message is for people and may change.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.common.proto.meshserve.v1.scheduler_pb2 import RequestError

_DETAILS_KEY = "grpc-status-details-bin"
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
ERROR_DOMAIN = "meshserve.v1"


class Reason(StrEnum):
    """ErrorInfo reasons: stable names for why a call failed."""

    INVALID_FIELD = "INVALID_FIELD"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    DRAINING = "DRAINING"
    NO_READY_WORKER = "NO_READY_WORKER"
    TOO_MANY_REQUESTS = "TOO_MANY_REQUESTS"
    RATE_LIMITED = "RATE_LIMITED"
    QUEUE_FULL = "QUEUE_FULL"
    CLIENT_TOO_SLOW = "CLIENT_TOO_SLOW"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    SCHEDULER_UNAVAILABLE = "SCHEDULER_UNAVAILABLE"
    WORKER_FAILED = "WORKER_FAILED"
    SHARED_MEMORY_UNREADABLE = "SHARED_MEMORY_UNREADABLE"
    INTERNAL = "INTERNAL"


# The reason of a status whose raiser named none: one per code.
_DEFAULT_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_FIELD,
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND: Reason.MODEL_NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.QUEUE_FULL,
    grpc.StatusCode.UNAVAILABLE: Reason.SCHEDULER_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
}


class StatusError(Exception):
    """Ends the current call with `status`; handlers raise it and abort in one place."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(f"{status.code.name}: {status.details}")
        self.status = status


def make_status(code: grpc.StatusCode, message: str, *details: Message, reason: Reason | None = None) -> grpc.Status:
    """A status with google.rpc details packed into grpc-status-details-bin, ErrorInfo always among them."""
    packed = []
    info = error_details_pb2.ErrorInfo(
        reason=reason or _DEFAULT_REASONS.get(code, Reason.INTERNAL), domain=ERROR_DOMAIN
    )
    for detail in (*details, info):
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=packed))


def invalid_argument_status(field: str, description: str) -> grpc.Status:
    """INVALID_ARGUMENT naming the field, with a BadRequest detail clients can read."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
    return make_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{field}: {description}",
        error_details_pb2.BadRequest(field_violations=[violation]),
    )


def retry_status(
    code: grpc.StatusCode, message: str, retry_after_seconds: float, reason: Reason | None = None
) -> grpc.Status:
    """A status advising when to retry (google.rpc.RetryInfo); no advice when retry_after_seconds <= 0."""
    if retry_after_seconds <= 0:
        return make_status(code, message, reason=reason)
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(round(retry_after_seconds * 1e9))
    return make_status(code, message, error_details_pb2.RetryInfo(retry_delay=delay), reason=reason)


def request_error_status(error: RequestError) -> grpc.Status:
    """The status a scheduler's RequestError stands for, with its field or its retry advice as details."""
    if error.field:
        return invalid_argument_status(error.field, error.description)
    code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    reason = Reason(error.reason) if error.reason in Reason.__members__ else None
    return retry_status(code, error.message, error.retry_after_seconds, reason)


async def abort_invalid_argument(context: grpc.aio.ServicerContext, field: str, description: str) -> NoReturn:
    """Fail the call with INVALID_ARGUMENT for one bad field."""
    await context.abort_with_status(invalid_argument_status(field, description))
    raise AssertionError("abort_with_status returned")  # pragma: no cover - abort always raises


async def abort_with_request_error(context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
    """Fail the call with a status the scheduler reported for one request (the field too, if it named one)."""
    await context.abort_with_status(request_error_status(error))
    raise AssertionError("abort returned")  # pragma: no cover - abort always raises


def _details(error: grpc.aio.AioRpcError) -> list[any_pb2.Any]:
    out: list[any_pb2.Any] = []
    for key, value in error.trailing_metadata() or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            out.extend(status_pb2.Status.FromString(value).details)
    return out


def field_violations(error: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    """The (field, description) pairs of a BadRequest detail in a received error."""
    out: list[tuple[str, str]] = []
    for detail in _details(error):
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out.extend((v.field, v.description) for v in bad.field_violations)
    return out


def error_reason(error: grpc.aio.AioRpcError) -> str | None:
    """The ErrorInfo reason of a received error, or None without one."""
    for detail in _details(error):
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return None


def retry_delay(error: grpc.aio.AioRpcError) -> float | None:
    """Seconds a received error's RetryInfo advises waiting, or None without one."""
    for detail in _details(error):
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return float(info.retry_delay.ToNanoseconds()) / 1e9
    return None
