"""`ApiError`, rendered in the OpenAI error shape, and the mapping of other errors onto it.

Bodies of 4xx answers say what was wrong with the request. Bodies of 5xx answers never carry
internal exception text: they name the request id, and the details go to the log under it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from stallfree.entrypoints.server.base.protocol import ErrorInfo, ErrorResponse
from stallfree.metrics.operator import ServerMetrics
from stallfree.runtime.request.errors import (
    EngineOverloadedError,
    EngineUnhealthyError,
    InvalidRequestError,
)

logger = logging.getLogger("stallfree.server")

# the type of every 5xx body; clients retry on 503 and report 500
SERVICE_UNAVAILABLE = "service_unavailable"
INTERNAL_ERROR = "internal_error"


class ApiError(Exception):
    """A request the server refuses; rendered in the OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: text a client sent (even a lone surrogate,
    which has no UTF-8 form) can always be echoed back."""

    def render(self, content: Any) -> bytes:
        return json.dumps(
            content, ensure_ascii=True, allow_nan=False, separators=(",", ":")
        ).encode()


def refusal_reason(status: int, code: str | None) -> str | None:
    """The reason `http_refusals_total` counts a refusal under (`metrics.names.REFUSAL_REASONS`);
    None for an answer that is not a refusal (the server's own failures, 5xx)."""
    if code == "shutting_down":
        return "shutting_down"
    if code == "overloaded":  # the Guard's limit, or the engine's queue full
        return "overloaded"
    if status == 413:
        return "body_too_large"
    if status == 408:
        return "timeout"
    if status == 401:
        return "unauthorized"
    if 400 <= status < 500:
        return "invalid_request"
    return None


def count_refusal(metrics: ServerMetrics | None, status: int, code: str | None) -> None:
    """Count an answer in `http_refusals_total` when it is a refusal and metrics are on."""
    reason = refusal_reason(status, code)
    if metrics is not None and reason is not None:
        metrics.refused(reason)


def error_body(info: ErrorInfo) -> bytes:
    return json.dumps(ErrorResponse(error=info).model_dump(), separators=(",", ":")).encode()


def error_json(
    status: int, info: ErrorInfo, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return AsciiJSONResponse(
        ErrorResponse(error=info).model_dump(), status_code=status, headers=headers
    )


def api_error_json(err: ApiError) -> JSONResponse:
    return error_json(err.status, err.info, err.headers)


def describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A one-line message and the first offending field of pydantic validation errors."""
    parts: list[str] = []
    param: str | None = None
    for err in list(errors)[:3]:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
        if err.get("type") == "invalid_unicode":
            # raised for the body as a whole; the context names the field
            field = err["ctx"]["field"]
            return f"{field}: {err['msg']}", field
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        # union members show up as loc parts like 'str' or 'list[int]'; drop them
        loc = [p for p in loc if not p.startswith(("str", "list[", "int", "function-"))]
        field = ".".join(loc) or "body"
        param = param or field
        parts.append(f"{field}: {err['msg']}")
    return "; ".join(parts) or "invalid request", param


def from_validation(exc: ValidationError) -> ApiError:
    message, param = describe_validation(exc.errors())
    return ApiError(400, message, param=param)


def from_invalid_request(exc: InvalidRequestError) -> ApiError:
    # an unknown LoRA adapter (unloaded while the request was admitted) is not found
    status = 404 if exc.code == "model_not_found" else 400
    return ApiError(status, exc.message, param=exc.param, code=exc.code)


def overloaded(retry_after_s: int, message: str) -> ApiError:
    return ApiError(
        503,
        message,
        type=SERVICE_UNAVAILABLE,
        code="overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def shutting_down(message: str = "the server is shutting down") -> ApiError:
    # Connection: close, so a client's pool does not send its next request here; Retry-After,
    # so a gateway (sglang-router, vllm-router) retries the request on another server
    return ApiError(
        503,
        message,
        type=SERVICE_UNAVAILABLE,
        code="shutting_down",
        headers={"Connection": "close", "Retry-After": "1"},
    )


def internal_error(request_id: str) -> ApiError:
    return ApiError(
        500,
        f"the server failed to complete this request (request id {request_id}); "
        "the details are in the server's log",
        type=INTERNAL_ERROR,
    )


EngineError = InvalidRequestError | EngineOverloadedError | EngineUnhealthyError
ENGINE_ERRORS = (InvalidRequestError, EngineOverloadedError, EngineUnhealthyError)
# what turning a client's values into engine inputs may raise; each is the client's fault
CONVERSION_ERRORS = (InvalidRequestError, ValidationError, OverflowError)


def from_conversion_error(exc: Exception, param: str | None = None) -> ApiError:
    """A 400 for a value that could not be turned into an engine input."""
    if isinstance(exc, InvalidRequestError):
        return from_invalid_request(exc)
    if isinstance(exc, ValidationError):
        return from_validation(exc)
    where = f"{param}: " if param else ""
    return ApiError(400, f"{where}a number is out of range", param=param)


def from_engine_error(exc: EngineError, retry_after_s: int, request_id: str) -> ApiError:
    """The `ApiError` for an engine's refusal to admit a request."""
    if isinstance(exc, InvalidRequestError):
        return from_invalid_request(exc)
    if isinstance(exc, EngineOverloadedError):
        why = str(exc) or "too many requests are waiting"  # the engine's counts, where named
        return overloaded(retry_after_s, f"the server is overloaded: {why}; retry later")
    logger.warning("request %s refused: the engine is unhealthy: %s", request_id, exc)
    return ApiError(
        503,
        f"the engine is unavailable: it failed closed and takes no new requests "
        f"(request id {request_id})",
        type=SERVICE_UNAVAILABLE,
        code="engine_unhealthy",
    )
