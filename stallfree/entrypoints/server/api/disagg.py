"""A server in a disaggregated role (`disaggregation.mode` prefill or decode).

Requests come through the router (`stallfree router`) and carry SGLang's bootstrap fields:
`bootstrap_host` and `bootstrap_port` (the prefill's bootstrap endpoint) and `bootstrap_room`
(the router's room id). Choice `i` of a request (its `n` choices, its prompts) is room
`bootstrap_room + i`, on both servers.

- prefill: each engine request runs with one output token; its answer is that token, sent once
  the decode side has the KV. The bootstrap endpoint runs beside the API.
- decode: each engine request waits for its KV, then decodes; `POST /disagg/connect` makes the
  handshake with a prefill ahead of any request (the router calls it at startup). Both name a
  prefill only from `disaggregation.prefill_hosts` (unset: loopback addresses); any other is a
  403 naming `bootstrap_host`, and nothing is contacted.

A failed transfer ends the request with a 503 (or an SSE error event) that names the stage.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from stallfree.disagg.bootstrap import BAD_UPSTREAM, BootstrapServer, ControlError
from stallfree.disagg.decode import DecodeSide
from stallfree.disagg.fingerprint import HandshakeError
from stallfree.disagg.guard import warn_if_open
from stallfree.disagg.prefill import PrefillSide
from stallfree.disagg.rooms import MAX_ROOM, RequestStalledError, RoomError
from stallfree.disagg.trust import UntrustedPrefillError
from stallfree.entrypoints.server.base.errors import ApiError
from stallfree.runtime.engine import Engine
from stallfree.runtime.request.errors import InvalidRequestError
from stallfree.runtime.request.outputs import GenerationChunk
from stallfree.runtime.request.sampling_params import SamplingParams

logger = logging.getLogger("stallfree.server")

# (prompt ids, params, engine request id, choice index) -> the request's chunks
Source = Callable[[list[int], SamplingParams, str, int], AsyncIterator[GenerationChunk]]

TRANSFER_FAILED = 503
STALLED = 504  # no progress for disaggregation.stall_timeout_s


class Disaggregated:
    """The role side of one server, with its bootstrap endpoint when it is a prefill."""

    def __init__(self, engine: Engine, side: PrefillSide | DecodeSide) -> None:
        self.engine, self.side = engine, side
        self.bootstrap: BootstrapServer | None = None

    @classmethod
    def for_engine(cls, engine: Engine) -> Disaggregated | None:
        cfg = engine.config.disaggregation
        if not cfg.enabled:
            return None
        if cfg.mode == "decode":
            return cls(engine, DecodeSide(engine, cfg))
        backend = cfg.transfer_backend
        if backend == "loopback":
            raise ValueError(
                "disaggregation.transfer_backend=loopback joins two engines in one process; "
                "a prefill server needs gloo or nccl (or auto)"
            )
        if backend == "auto":
            backend = "nccl" if engine.core.ctx.kv_cache.device.type == "cuda" else "gloo"
        return cls(engine, PrefillSide(engine, cfg, engine.config.faults, backend=backend))

    async def start(self) -> None:
        await self.side.start()
        if isinstance(self.side, PrefillSide):
            cfg = self.engine.config.disaggregation
            warn_if_open(cfg.bootstrap_host, cfg.secret)
            self.bootstrap = BootstrapServer(self.side, cfg.bootstrap_host, cfg.bootstrap_port)
            await self.bootstrap.start()
            logger.warning("prefill bootstrap endpoint at %s", self.bootstrap.url)

    async def stop(self) -> None:
        if self.bootstrap is not None:
            await self.bootstrap.stop()
        await self.side.close()

    def render_metrics(self) -> bytes:
        return self.side.stats.render()

    def source(self, body: Any) -> Source:
        """The engine requests of one API request, from its bootstrap fields (400 without)."""
        fields = _bootstrap_fields(body)
        room, host, port = (fields[name] for name in _BOOTSTRAP)
        side = self.side
        role = "prefill" if isinstance(side, PrefillSide) else "decode"
        if room is None or (role == "decode" and (host is None or port is None)):
            need = (
                "bootstrap_room"
                if role == "prefill"
                else "bootstrap_host, bootstrap_port and bootstrap_room"
            )
            raise ApiError(
                400,
                f"this is a {role} server of a disaggregated deployment: send requests through "
                f"its router, which sets {need}",
                param="bootstrap_room",
            )
        n = getattr(body, "n", None) or 1
        if isinstance(side, DecodeSide):
            assert host is not None and port is not None
            for p in range(_prompt_count(body)):
                _check_trusted(side, _of_prompt(host, p), _of_prompt(port, p))

        def each(
            ids: list[int], params: SamplingParams, rid: str, index: int
        ) -> AsyncIterator[GenerationChunk]:
            if params.logprobs is not None or params.prompt_logprobs is not None:
                # NOTE: the first token's logprobs are the prefill's, and are not carried over
                raise InvalidRequestError(
                    "logprobs are not served by disaggregated servers yet",
                    param="logprobs",
                )
            # a scalar room is choice 0's (choice i is room + i); a list holds each prompt's
            p, choice = divmod(index, n) if isinstance(room, list) else (0, index)
            sub = (_of_prompt(room, p) + choice) % (MAX_ROOM + 1)
            if isinstance(side, PrefillSide):
                return _prefill(side, ids, params, rid, sub)
            assert host is not None and port is not None
            return _decode(side, ids, params, rid, sub, _of_prompt(host, p), _of_prompt(port, p))

        return each


_BOOTSTRAP = ("bootstrap_room", "bootstrap_host", "bootstrap_port")
_T = TypeVar("_T")


def _prompt_count(body: Any) -> int:
    """A completions request's prompts (a list of texts or of token lists); 1 otherwise."""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _bootstrap_fields(body: Any) -> dict[str, Any]:
    """The three fields; one in list form (sglang-router's, for a list of prompts) must hold
    one entry per prompt, or the request is a 400 naming it."""
    fields = {name: getattr(body, name, None) for name in _BOOTSTRAP}
    count = _prompt_count(body)
    for name, value in fields.items():
        if isinstance(value, list) and len(value) != count:
            raise ApiError(
                400,
                f"{name} has {len(value)} entries for {count} prompt(s): send one per prompt, "
                "or one value for all",
                param=name,
            )
    return fields


def _of_prompt(value: _T | list[_T], p: int) -> _T:
    return value[p] if isinstance(value, list) else value


def _check_trusted(side: DecodeSide, host: str, port: int) -> None:
    """A 403 naming `bootstrap_host` for a prefill this decode server does not trust."""
    try:
        side.trusted.check(host, port)
    except UntrustedPrefillError as exc:
        raise ApiError(403, str(exc), param="bootstrap_host", code="untrusted_prefill") from exc


def failure_chunk(rid: str, message: str, status: int = TRANSFER_FAILED) -> GenerationChunk:
    """The last chunk of a request whose hand-over failed: the client sees `message`."""
    return GenerationChunk(
        rid,
        [],
        "",
        finished=True,
        finish_reason="error",
        error=message,
        error_status=status,
    )


async def _prefill(
    side: PrefillSide, ids: list[int], params: SamplingParams, rid: str, room: int
) -> AsyncIterator[GenerationChunk]:
    try:
        chunk = await side.prefill(ids, params, rid, room)
    except RoomError as exc:
        chunk = failure_chunk(rid, f"KV transfer failed ({exc.stage}): {exc}")
    except RequestStalledError as exc:
        chunk = failure_chunk(rid, str(exc), STALLED)
    yield chunk


async def _decode(
    side: DecodeSide,
    ids: list[int],
    params: SamplingParams,
    rid: str,
    room: int,
    host: str,
    port: int,
) -> AsyncIterator[GenerationChunk]:
    gen = side.generate(ids, params, rid, room, host, port)
    try:
        async for chunk in gen:
            yield chunk
    except RoomError as exc:
        yield failure_chunk(rid, f"KV transfer failed ({exc.stage}): {exc}")
    except RequestStalledError as exc:
        yield failure_chunk(rid, str(exc), STALLED)
    except HandshakeError as exc:
        yield failure_chunk(rid, f"cannot decode for prefill {host}:{port}: {exc}")
    except ControlError as exc:
        status = BAD_UPSTREAM if exc.status == BAD_UPSTREAM else TRANSFER_FAILED
        yield failure_chunk(rid, f"prefill {host}:{port}: {exc}", status)
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


class ConnectBody(BaseModel):
    bootstrap_host: str = Field(min_length=1, max_length=253)
    bootstrap_port: int = Field(ge=1, le=65535)


def disagg_routes() -> APIRouter:
    router = APIRouter()

    @router.post("/disagg/connect", response_model=None)
    async def connect(body: ConnectBody, request: Request) -> Any:
        dis: Disaggregated | None = request.app.state.sf.disagg
        if dis is None or not isinstance(dis.side, DecodeSide):
            raise ApiError(404, "this server is not a decode server (disaggregation.mode)")
        _check_trusted(dis.side, body.bootstrap_host, body.bootstrap_port)
        try:
            link = await dis.side.connect(body.bootstrap_host, body.bootstrap_port)
        except HandshakeError as exc:
            raise ApiError(409, f"handshake refused: {exc}", code="disagg_mismatch") from exc
        except ControlError as exc:
            raise ApiError(502, str(exc), type="upstream_error") from exc
        return JSONResponse({"status": "paired", "pair_id": link.pair_id})

    return router
