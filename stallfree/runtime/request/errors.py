"""Errors the engine raises to its callers; front ends map them to protocol errors."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request itself is wrong (empty, too long, bad token ids); the engine keeps serving.

    `param` names the offending request field and `code` is a machine-readable reason, so a
    front end can report them without re-deriving the check.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full, or the engine is shutting down."""


class EngineClosedError(EngineOverloadedError):
    """The engine is not running: not started yet, or shut down. (An `EngineOverloadedError`,
    so code that treats both as "try elsewhere" keeps working.)"""


def check_waiting_room(waiting: int, inputs: int, limit: int) -> None:
    """`EngineOverloadedError` for a call whose `inputs` (one waiting request each) would take
    a waiting queue of `waiting` requests past its `limit`: a call is queued whole or not. A
    call of more inputs than the whole queue holds could never be queued, so it is an
    `InvalidRequestError` (a 400 the client must act on) rather than a 503 to retry."""
    if inputs > limit:
        raise InvalidRequestError(
            f"this call has {inputs} inputs, more than the waiting queue holds ({limit} "
            f"requests, scheduler.max_waiting_requests); send at most {limit} inputs per call",
            param="input",
            code="too_many_inputs",
        )
    if waiting + inputs > limit:
        raise EngineOverloadedError(
            f"this call's {inputs} inputs would take the waiting queue past its limit of "
            f"{limit} requests ({waiting} waiting)"
        )


class EngineUnhealthyError(RuntimeError):
    """The engine failed closed (repeated step failures, or a lost worker) and takes no new work."""
