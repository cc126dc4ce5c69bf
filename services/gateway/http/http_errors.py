"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with an HTTP status per gRPC code.

The pipeline's StatusErrors carry google.rpc details in the status's grpc-status-details-bin trailer: a
BadRequest field violation becomes `param` (mapped back to the OpenAI field name), RetryInfo becomes
Retry-After on 429 and 503, and ErrorInfo's stable reason becomes `code` ("model_not_found", ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from starlette.responses import JSONResponse

from services.common.sampling_checks import InvalidField

_DETAILS_KEY = "grpc-status-details-bin"

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# The OpenAI SDK's exception class names (vLLM answers with the same types).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


@dataclass
class OpenAIError(Exception):
    """An error ready to send: its HTTP status, message, the OpenAI parameter at fault and retry advice."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    # Seconds to wait before retrying (the Retry-After header), when the server advises it.
    retry_after: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        kind = ERROR_TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Retry-After (whole seconds, rounded up) when the server advises a wait."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(0, math.ceil(self.retry_after)))}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """The error as an HTTP response."""
        return JSONResponse(self.body(), self.status, headers={**(headers or {}), **self.headers()})


def _details(status: grpc.Status) -> list[any_pb2.Any]:
    out: list[any_pb2.Any] = []
    for key, value in getattr(status, "trailing_metadata", None) or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            out.extend(status_pb2.Status.FromString(value).details)
    return out


def _same(field: str) -> str:
    return field


def from_status(status: grpc.Status, param_of: Callable[[str], str] = _same) -> OpenAIError:
    """The OpenAI error for a pipeline status; param_of maps a BadRequest field to the OpenAI name."""
    http = HTTP_STATUS.get(status.code, 500)
    message = status.details or status.code.name
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None
    for detail in _details(status):
        bad, retry, info = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo(), error_details_pb2.ErrorInfo()
        if detail.Unpack(bad) and bad.field_violations and param is None:
            violation = bad.field_violations[0]
            param = param_of(violation.field)
            message = f"{param}: {violation.description}"
        elif detail.Unpack(retry):
            retry_after = retry.retry_delay.ToNanoseconds() / 1e9
        elif detail.Unpack(info) and info.reason:
            code = info.reason.lower()
    return OpenAIError(http, message, param, code, retry_after if http in (429, 503) else None)


def from_invalid_field(err: InvalidField, param_of: Callable[[str], str] = _same) -> OpenAIError:
    """400 naming the field ("" names none: the body as a whole)."""
    if not err.field:
        return OpenAIError(400, err.description, None, "invalid_field")
    param = param_of(err.field)
    return OpenAIError(400, f"{param}: {err.description}", param, "invalid_field")


def internal_error() -> OpenAIError:
    """500 for a bug: nothing about it goes to the client (the gateway logs it)."""
    return OpenAIError(500, "internal error; the gateway's log has the details", None, "internal")
