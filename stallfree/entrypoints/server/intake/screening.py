"""What a request body must pass before it is used, and where that runs.

`screen` holds the checks of an OpenAI body that need no engine: the model name, the fields
whose values this server does not support, and a chat's size (messages, and content parts and
tool calls over all of them).

Parsing a body dense with JSON values holds the GIL: 120k empty messages (4 MB) cost `json`
and pydantic about 0.3 s of it, in stretches of up to 150 ms, and a worker thread that holds
the GIL starves the event loop as surely as the loop itself would (eight such bodies kept
`/health` waiting 0.7 s). So a body of `OFF_LOOP_BODY_BYTES` or more that is dense (at least
`DENSE_SEPARATORS` of `{`, `[` and `,`) is parsed, validated and screened in a separate process
(`screen_elsewhere`), which answers with the error, or with the validated body; what passes the
screen is bounded by it, so taking it back is cheap. Bodies wait for it in turn per client, and
one it does not answer within `server.screening_timeout_s` is a 503 and a new process
(`screening_queue.py`). A large body that is not dense (long text)
parses at C speed and is validated in the worker thread (`requests.read_body`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from stallfree.config.settings import ServerConfig
from stallfree.entrypoints.server.base.errors import SERVICE_UNAVAILABLE, ApiError
from stallfree.entrypoints.server.base.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.entrypoints.server.intake.screening_queue import FairScreening, ScreeningTimeout

if TYPE_CHECKING:
    from stallfree.runtime.engine import Engine

BodyModel = TypeVar("BodyModel", bound=BaseModel)

# bodies at least this large are parsed and validated off the event loop
OFF_LOOP_BODY_BYTES = 64 * 1024
# ... and, when they hold at least this many `{`, `[` and `,`, in the screening process: about
# 8k messages' worth, which parse and validate in well under 10 ms
DENSE_SEPARATORS = 32 * 1024


def is_dense(raw: bytes) -> bool:
    """Whether `raw` may hold `DENSE_SEPARATORS` JSON values or more (separators inside strings
    count too: a long text with many commas is screened in the process, at no harm)."""
    return raw.count(b",") + raw.count(b"{") + raw.count(b"[") >= DENSE_SEPARATORS


def validate_body(model: type[BodyModel], raw: bytes) -> BodyModel:
    """`raw` as `model`, with FastAPI's own error shapes (a `RequestValidationError` whose
    locations start at "body"), so the 400s read as FastAPI's would."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", getattr(exc, "start", 0))
        error = getattr(exc, "msg", str(exc))
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": error},
                }
            ]
        ) from None
    except RecursionError:  # nested past Python's recursion limit
        raise ApiError(400, "malformed JSON body: nested too deeply", param="body") from None
    except ValueError:  # an integer longer than Python converts (`sys.get_int_max_str_digits`)
        raise _number_too_long(raw) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise RequestValidationError(errors) from None


_FIELD_SHOWN = 200


@dataclass(frozen=True, slots=True)
class _LongInteger:
    """Where `json.loads` met an integer of `digits` digits, too long to convert."""

    digits: int


def _number_too_long(raw: bytes) -> ApiError:
    """The 400 for a body holding an integer of more digits than Python converts, naming the
    first field that holds one (the body parsed again, each such integer left as a marker: only
    on this error path, so no other body pays for the search)."""

    def integer(text: str) -> int | _LongInteger:
        try:
            return int(text)
        except ValueError:
            return _LongInteger(len(text.lstrip("-")))

    try:
        data = json.loads(raw, parse_int=integer)
    except json.JSONDecodeError as exc:  # malformed after the long integer
        return ApiError(400, f"malformed JSON body: {exc}", param="body")
    except RecursionError:  # nested too deeply after it
        return ApiError(400, "malformed JSON body: nested too deeply", param="body")
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:  # depth first, in the body's order
        value, path = stack.pop()
        if isinstance(value, _LongInteger):
            field = ".".join(path) or "body"
            if len(field) > _FIELD_SHOWN:  # the client's keys, echoed at most this long
                field = field[:_FIELD_SHOWN] + "..."
            limit = sys.get_int_max_str_digits()
            return ApiError(
                400,
                f"{field}: a number of {value.digits} digits is too long "
                f"(integers may have at most {limit} digits)",
                param=field,
            )
        if isinstance(value, dict):
            stack.extend((v, (*path, str(k))) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, (*path, str(i))) for i, v in reversed(list(enumerate(value))))
    return ApiError(400, "malformed JSON body: a number is too long", param="body")


# ---------------------------------------------------------------- the checks


def model_adapter(engine: Engine, served: str, name: str) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model); an unknown name is
    a 404 (`check_model`)."""
    lora = engine.lora
    if name != served and lora is not None and name in lora.adapters:
        return name
    check_model(served, name)
    return None


def check_model(served: str, name: str) -> None:
    # only the served name: with --served-model-name set, the model's path stays private
    if name != served:
        # a client's id is echoed at most this long, so the answer cannot be made to grow
        shown = repr(name[:64]) + (
            f" (and {len(name) - 64} more characters)" if len(name) > 64 else ""
        )
        serves = "GET /v1/models names it" if on_disk(served) else f"it is {served!r}"
        raise ApiError(
            404,
            f"the model {shown} does not exist; this server serves one model: {serves}",
            param="model",
            code="model_not_found",
        )


def on_disk(name: str) -> bool:
    """Whether a served model id is a path of the server's disk (a model directory served
    under its path), which an error text does not show."""
    return os.path.isabs(name) or (os.sep in name and os.path.exists(name))


def _given(value: Any) -> bool:
    """Set to something other than nothing (None, false, an empty string, list or object)."""
    return value is not None and value is not False and value != "" and value != [] and value != {}


# fields that would change the output, and the values of them this server can honour
# (their defaults); any other value is a 400 naming the field. Fields not declared at all are
# ignored (see `protocol._Request`).
_SHARED_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": lambda v: v is None or v is False,
}
_COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v is None or v == "",
}
_CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: not _given(v),
    "function_call": lambda v: v is None or v == "none",
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "chat_template": lambda v: v is None,
}


def reject_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 naming the first field whose value would change the output in a way this server
    does not support."""
    table = dict(_SHARED_UNSUPPORTED)
    table |= _COMPLETION_UNSUPPORTED if isinstance(body, CompletionRequest) else _CHAT_UNSUPPORTED
    for field, supported in table.items():
        if not supported(getattr(body, field)):
            raise ApiError(
                400,
                f"{field}: this value is not supported by this server",
                param=field,
                code="unsupported_parameter",
            )
    if body.stream and body.prompt_logprobs is not None:
        raise ApiError(
            400, "prompt_logprobs: not available when stream is true", param="prompt_logprobs"
        )
    if isinstance(body, CompletionRequest):
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(
                400,
                f"best_of: only best_of equal to n ({body.n}) is supported, not {body.best_of}",
                param="best_of",
                code="unsupported_parameter",
            )
    else:
        if body.top_logprobs and not body.logprobs:
            raise ApiError(
                400, "top_logprobs: set logprobs to true to use it", param="top_logprobs"
            )
        check_prefill(body.add_generation_prompt, body.continue_final_message)


def check_prefill(add_generation_prompt: bool | None, continue_final_message: bool) -> None:
    """vLLM's assistant prefill: `continue_final_message` continues the chat's final message
    (no new turn is opened), so `add_generation_prompt` may not also be true. Without it,
    `add_generation_prompt: false` renders the chat with no assistant header at its end, and
    generation goes on from there, as vLLM does."""
    if continue_final_message and add_generation_prompt:
        raise ApiError(
            400,
            "add_generation_prompt: cannot be true with continue_final_message: the final "
            "message is continued, so no new turn is opened (set it to false)",
            param="add_generation_prompt",
        )


def check_chat_size(body: ChatCompletionRequest, limits: ServerConfig) -> None:
    """At most `max_chat_messages` messages, and `max_content_parts` content parts and tool
    calls over all the messages, before any of them is rendered."""
    messages = body.messages
    if len(messages) > limits.max_chat_messages:
        raise ApiError(
            400,
            f"messages: a chat request may hold at most {limits.max_chat_messages} messages "
            f"(server.max_chat_messages), and this one holds {len(messages)}",
            param="messages",
            code="too_many_messages",
        )
    parts = [len(m.content) if isinstance(m.content, list) else 0 for m in messages]
    calls = [len(m.tool_calls or ()) for m in messages]
    total = sum(parts) + sum(calls)
    if total <= limits.max_content_parts:
        return
    # the message whose parts or calls go past the limit
    seen = itertools.accumulate(p + c for p, c in zip(parts, calls, strict=True))
    at = next(i for i, upto in enumerate(seen) if upto > limits.max_content_parts)
    param = f"messages.{at}.{'content' if parts[at] else 'tool_calls'}"
    raise ApiError(
        400,
        f"{param}: a chat request may hold at most {limits.max_content_parts} content parts "
        f"and tool calls over all its messages (server.max_content_parts), and this one "
        f"holds {total}",
        param=param,
        code="too_many_content_parts",
    )


@dataclass(frozen=True, slots=True)
class Screen:
    """What `screen` checks a body against: the served model's name and the server's limits."""

    served_model: str | None  # None: the route checks the name (LoRA adapters come and go)
    limits: ServerConfig


def screen(body: BaseModel, against: Screen) -> None:
    """The engine-free checks of an OpenAI body, in the order the routes make them."""
    if isinstance(body, CompletionRequest | ChatCompletionRequest):
        if against.served_model is not None:
            check_model(against.served_model, body.model)
        reject_unsupported(body)
    if isinstance(body, ChatCompletionRequest):
        check_chat_size(body, against.limits)


# ---------------------------------------------------------------- the screening process


def _screened(model: type[BaseModel], raw: bytes, against: Screen) -> tuple[Any, ...]:
    """In the screening process: `raw` parsed, validated and screened; ("ok", body), or the
    error as plain values (what a client sent is not sent back: an error's `input` can be the
    whole body)."""
    try:
        body = validate_body(model, raw)
        screen(body, against)
    except RequestValidationError as exc:
        errors = [{k: v for k, v in e.items() if k not in ("input", "url")} for e in exc.errors()]
        return ("invalid", errors)
    except ApiError as exc:
        info = exc.info
        return ("api", exc.status, info.message, info.param, info.code)
    return ("ok", body)


_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()
# how often the screening process looks whether the server that started it is still there
_PARENT_POLL_S = 0.5


def _watch_parent(parent: int) -> None:
    """In the screening process: exit once the server is gone. A server killed outright
    (SIGKILL, the OOM killer) never stops its pool, and the process would wait forever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="stallfree-screen-parent", daemon=True).start()


def _screening_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # one process: dense bodies queue behind one another there, and take at most one
            # core from the engine; "spawn", since forking a process that holds a model and
            # threads is not safe
            _pool = ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_watch_parent,
                initargs=(os.getpid(),),
            )
        return _pool


def _restart(broken: ProcessPoolExecutor, kill: bool) -> None:
    """Drop `broken` so the next body starts a new process; `kill`: it is stuck, so end it."""
    global _pool
    with _pool_lock:
        if _pool is broken:
            _pool = None
    if kill:
        # NOTE: the executor names no public way to its processes; a stopped (SIGSTOP) or
        # looping one never takes the shutdown's sentinel, so it is killed outright
        for process in list((getattr(broken, "_processes", None) or {}).values()):
            process.kill()
    broken.shutdown(wait=False, cancel_futures=True)


# through the module's names, so a test may put another pool in their place
_queue = FairScreening(lambda: _screening_pool(), lambda pool, kill: _restart(pool, kill))


def screening_queue() -> FairScreening:
    """The process's one queue in front of the screening process."""
    return _queue


async def screen_elsewhere(
    model: type[BodyModel], raw: bytes, against: Screen, client: str
) -> BodyModel:
    """`raw` parsed, validated and screened in the screening process, in `client`'s turn;
    raises what the checks raise, as they would have here."""
    deadline = against.limits.screening_timeout_s
    future = _queue.submit(client, deadline, _screened, model, raw, against)
    try:
        answer = await asyncio.wrap_future(future)
    except BrokenProcessPool:
        # the process died under this body (out of memory, or killed): the next starts anew
        raise ApiError(
            400,
            "the request body could not be checked: the process checking it stopped",
            param="body",
            code="body_unchecked",
        ) from None
    except ScreeningTimeout:
        raise ApiError(
            503,
            f"the request body could not be checked within server.screening_timeout_s "
            f"({deadline:g} s); the process checking it was restarted, try again",
            type=SERVICE_UNAVAILABLE,
            code="screening_timeout",
            headers={"Retry-After": "1"},
        ) from None
    if answer[0] == "invalid":
        raise RequestValidationError(answer[1])
    if answer[0] == "api":
        _, status, message, param, code = answer
        raise ApiError(status, message, param=param, code=code)
    body: BodyModel = answer[1]
    return body


def close_screening() -> None:
    """Stop the screening process, if one was started (it starts again when needed), once the
    bodies given to it are answered: another app of this process may be waiting on them."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True)


def check_runner(engine: Engine, wanted: str, route: str, why: str | None = None) -> None:
    """A route of the other runner is a 400 naming the runner this server has (and `why` its
    model does not serve the route, where that is known)."""
    if engine.runner == wanted:
        return
    serves = (
        "/v1/embeddings, /pooling, /v1/score and /v1/rerank, as its model allows"
        if engine.runner == "pooling"
        else "completions and chat"
    )
    reason = f"; its model cannot pool here: {why}" if why else ""
    raise ApiError(
        400,
        f"{route} needs the {wanted} runner; this server runs the {engine.runner} runner "
        f"(it serves {serves}){reason}; start it with --runner {wanted} and a model that fits",
        code="wrong_runner",
    )


def check_embedder(engine: Engine, route: str) -> None:
    """An embeddings route: the pooling runner serves it, and so does a generating engine
    whose model pools (`Engine.embeddings`); anything else is `check_runner`'s 400."""
    if engine.runner == "generate" and engine.embeddings is not None:
        return
    why = engine.embed_refusal if engine.runner == "generate" else None
    check_runner(engine, "pooling", route, why)
