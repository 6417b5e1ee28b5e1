"""`/v1/embeddings` (OpenAI's) and `/pooling` (vLLM's): an embedder's vectors, served by the
pooling runner, and by a generating server whose model pools (a native decoder family)."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from stallfree.entrypoints.server.base.embedding_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingData,
    PoolingResponse,
)
from stallfree.entrypoints.server.base.errors import (
    ENGINE_ERRORS,
    SERVICE_UNAVAILABLE,
    ApiError,
    from_engine_error,
    shutting_down,
)
from stallfree.entrypoints.server.base.state import ServerState, request_id, server_state
from stallfree.entrypoints.server.intake.requests import read_body
from stallfree.entrypoints.server.intake.screening import check_embedder, check_model
from stallfree.runtime.engine import Engine
from stallfree.runtime.pooled import Pooled, PoolingAborted
from stallfree.runtime.request.errors import EngineClosedError


async def embeddings(request: Request) -> Response:
    body, state, result = await _pool(request, "/v1/embeddings")
    answer = EmbeddingResponse(
        id=f"embd-{request_id(request)}",
        created=int(time.time()),
        model=state.model_name,
        data=[
            EmbeddingData(index=i, embedding=vector)
            for i, vector in enumerate(_encoded(result, body.encoding_format))
        ],
        usage=EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens),
    )
    return JSONResponse(answer.model_dump())


async def pooling(request: Request) -> Response:
    """vLLM's `/pooling`: the embedder's pooled output, as `/v1/embeddings` computes it, in
    vLLM's answer shape (`object: "pooling"`, the vector under `data`)."""
    body, state, result = await _pool(request, "/pooling")
    answer = PoolingResponse(
        id=f"pool-{request_id(request)}",
        created=int(time.time()),
        model=state.model_name,
        data=[
            PoolingData(index=i, data=vector)
            for i, vector in enumerate(_encoded(result, body.encoding_format))
        ],
        usage=EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens),
    )
    return JSONResponse(answer.model_dump())


async def _pool(request: Request, route: str) -> tuple[EmbeddingRequest, ServerState, Pooled]:
    body = await read_body(request, EmbeddingRequest)
    state = server_state(request)
    check_model(state.model_name, body.model)
    check_embedder(state.engine, route)
    rid = request_id(request)
    with pooling_request(state, rid) as engine:
        result = await engine.embed(
            body.inputs(), body.dimensions, body.truncate_prompt_tokens, rid=rid
        )
    return body, state, result


@dataclass(eq=False)
class _Admitted:
    """A pooling request as the server's lifecycle sees it: `/abort_requests` names it by the
    HTTP request's id, and the drain's grace period ends it."""

    engine: Engine
    rid: str

    def abort(self) -> None:
        self.engine.abort(self.rid)

    def names(self) -> tuple[str, ...]:
        return (self.rid,)


@contextlib.contextmanager
def pooling_request(state: ServerState, rid: str) -> Iterator[Engine]:
    """The pooling engine for one request with id `rid`, admitted into the server's lifecycle
    while it runs; its refusals as the server's answers: 503 while closing or once aborted,
    504 past the request's deadline, the other engine errors as every route answers them."""
    engine = state.engine
    admitted = _Admitted(engine, rid)
    state.lifecycle.admitted.add(admitted)
    try:
        yield engine
    except EngineClosedError as exc:
        raise shutting_down() from exc
    except PoolingAborted as exc:
        if state.lifecycle.expired:
            raise shutting_down() from exc
        raise ApiError(
            503, f"{exc} (/abort_requests)", type=SERVICE_UNAVAILABLE, code="aborted"
        ) from exc
    except TimeoutError as exc:  # runtime.request_timeout_s passed; the request was dropped
        raise ApiError(
            504,
            f"the request passed its deadline of {engine.config.runtime.request_timeout_s} s",
            type="timeout_error",
            code="deadline_exceeded",
        ) from exc
    except ENGINE_ERRORS as exc:
        raise from_engine_error(exc, state.limits.retry_after_s, rid) from exc
    finally:
        state.lifecycle.admitted.discard(admitted)


def _encoded(result: Pooled, encoding: str) -> list[list[float]] | list[str]:
    vectors = result.outputs
    if encoding == "base64":
        # OpenAI's encoding: the float32 values' bytes, little-endian, in base64
        return [
            base64.b64encode(row.contiguous().numpy().astype("<f4").tobytes()).decode()
            for row in vectors
        ]
    rows: list[list[float]] = vectors.tolist()
    return rows
