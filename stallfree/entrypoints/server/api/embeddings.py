"""`/v1/embeddings` (OpenAI's) and `/pooling` (vLLM's): an embedder's vectors, served by the
pooling runner."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Iterator

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
    ApiError,
    from_engine_error,
    shutting_down,
)
from stallfree.entrypoints.server.base.state import ServerState, request_id, server_state
from stallfree.entrypoints.server.intake.requests import read_body
from stallfree.entrypoints.server.intake.screening import check_model, check_runner
from stallfree.runtime.pooler import Pooled, PoolingEngine
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
    check_runner(state.engine, "pooling", route)
    engine = state.engine
    assert isinstance(engine, PoolingEngine)
    with pooling_refusals(state, request_id(request)):
        result = await engine.embed(body.inputs(), body.dimensions, body.truncate_prompt_tokens)
    return body, state, result


@contextlib.contextmanager
def pooling_refusals(state: ServerState, rid: str) -> Iterator[None]:
    """The pooling engine's refusals as the server's answers: 503 while closing, 504 past the
    request's deadline, the other engine errors as every route answers them."""
    try:
        yield
    except EngineClosedError as exc:
        raise shutting_down() from exc
    except TimeoutError as exc:  # runtime.request_timeout_s passed; the request was dropped
        raise ApiError(
            504,
            f"the request passed its deadline of {state.engine.config.runtime.request_timeout_s} s",
            type="timeout_error",
            code="deadline_exceeded",
        ) from exc
    except ENGINE_ERRORS as exc:
        raise from_engine_error(exc, state.limits.retry_after_s, rid) from exc


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
