"""`ApiError`, rendered in the OpenAI error shape, and the mapping of other errors onto it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from stallfree.entrypoints.server.protocol import ErrorInfo, ErrorResponse
from stallfree.runtime.errors import (
    EngineOverloadedError,
    EngineUnhealthyError,
    InvalidRequestError,
)


class ApiError(Exception):
    """A request the server refuses; rendered in the OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


def error_json(status: int, info: ErrorInfo) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


def describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A one-line message and the first offending field of pydantic validation errors."""
    parts: list[str] = []
    param: str | None = None
    for err in list(errors)[:3]:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
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
    return ApiError(400, exc.message, param=exc.param, code=exc.code)


EngineError = InvalidRequestError | EngineOverloadedError | EngineUnhealthyError
ENGINE_ERRORS = (InvalidRequestError, EngineOverloadedError, EngineUnhealthyError)


def from_engine_error(exc: EngineError) -> ApiError:
    """The `ApiError` for an engine's refusal to admit a request."""
    if isinstance(exc, InvalidRequestError):
        return from_invalid_request(exc)
    if isinstance(exc, EngineOverloadedError):
        return ApiError(503, str(exc), type="service_unavailable", code="overloaded")
    return ApiError(503, str(exc), type="service_unavailable", code="engine_unhealthy")
