"""`/v1/score` (vLLM's) and `/v1/rerank` (Jina's and Cohere's shape; `/rerank` and
`/v2/rerank` too): a cross-encoder's relevance of text pairs, on the pooling runner."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from stallfree.entrypoints.server.api.embeddings import pooling_request
from stallfree.entrypoints.server.base.errors import ApiError
from stallfree.entrypoints.server.base.score_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from stallfree.entrypoints.server.base.state import ServerState, request_id, server_state
from stallfree.entrypoints.server.intake.requests import read_body
from stallfree.entrypoints.server.intake.screening import check_model, check_runner
from stallfree.runtime.pooled import Pooled
from stallfree.runtime.pooler import PoolingEngine
from stallfree.runtime.scheduled_pooler import ScheduledPoolingEngine


async def score(request: Request) -> Response:
    body = await read_body(request, ScoreRequest)
    state = _open(request, body.model)
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not first or not second:
        raise ApiError(400, "text_1 and text_2 must not be empty", param="text_1")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ApiError(
            400,
            f"text_1 has {len(first)} texts and text_2 {len(second)}: send one text_1, or "
            "as many as text_2",
            param="text_2",
        )
    result = await _score(
        state, request, list(zip(first, second, strict=True)), body.truncate_prompt_tokens
    )
    answer = ScoreResponse(
        id=f"score-{request_id(request)}",
        created=int(time.time()),
        model=state.model_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(result.outputs.tolist())],
        usage=ScoreUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens),
    )
    return JSONResponse(answer.model_dump())


async def rerank(request: Request) -> Response:
    body = await read_body(request, RerankRequest)
    state = _open(request, body.model)
    texts = body.texts()
    if not texts:
        raise ApiError(400, "documents must not be empty", param="documents")
    result = await _score(
        state, request, [(body.query, t) for t in texts], body.truncate_prompt_tokens
    )
    scores = result.outputs.tolist()
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if body.top_n is not None:
        order = order[: body.top_n]
    answer = RerankResponse(
        id=f"rerank-{request_id(request)}",
        model=state.model_name,
        usage=RerankUsage(total_tokens=result.prompt_tokens),
        results=[
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=texts[i]) if body.return_documents else None,
            )
            for i in order
        ],
    )
    return JSONResponse(answer.model_dump(exclude_none=True))


def _open(request: Request, model: str) -> ServerState:
    state = server_state(request)
    check_model(state.model_name, model)
    check_runner(state.engine, "pooling", request.url.path)
    return state


async def _score(
    state: ServerState, request: Request, pairs: list[tuple[str, str]], truncate: int | None
) -> Pooled:
    rid = request_id(request)
    with pooling_request(state, rid) as engine:
        # the pooling runner's engines score (a cross-encoder) or refuse with a 400
        assert isinstance(engine, (PoolingEngine, ScheduledPoolingEngine))
        return await engine.score(pairs, truncate, rid=rid)
