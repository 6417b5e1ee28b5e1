"""The worker probes of the Rust routers operators put in front of several servers, in the
shapes SGLang and vLLM answer them, behind the API key like the other routes:

- sglang-router, when a worker joins: `GET /server_info` (utility.py adds SGLang's flat keys
  to stallfree's own), `GET /model_info` (`/get_model_info` on older routers), from which it
  takes the model's id (`served_model_name`, else `model_path`); `GET /get_server_info` is
  the older spelling of `/server_info`;
- SGLang's `GET /get_load`: one entry per data-parallel rank (stallfree has one) with the
  requests running and waiting and the tokens they hold, for a load-aware policy;
- SGLang's `GET /health_generate`: 200 once a one-token greedy generation has run (a
  disaggregated server, which generates only through its router, answers as `/health` does);
- vLLM's `POST /v1/completions/render` and `POST /v1/chat/completions/render`, which
  vllm-router calls for a request's token ids before it routes it (a 404 sends it to
  `/tokenize` first): the prompts as the generation routes would tokenize them, and nothing
  generated. Completions: one `{prompt, prompt_token_ids}` per prompt; chat: the conversation
  and a list of one such prompt.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from stallfree import __version__
from stallfree.entrypoints.server.api.openai_api import open_request
from stallfree.entrypoints.server.base.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.entrypoints.server.base.state import ServerState, server_state
from stallfree.entrypoints.server.chat.tools import plan_chat
from stallfree.entrypoints.server.intake.requests import (
    chat_prompt_ids_async,
    converting,
    prompt_ids_async,
    read_body,
    truncated,
)
from stallfree.entrypoints.server.intake.screening import check_chat_size
from stallfree.runtime.request.outputs import GenerationChunk
from stallfree.runtime.request.sampling_params import SamplingParams

# the longest /health_generate waits for its token before it answers 503
HEALTH_GENERATE_TIMEOUT_S = 20.0


def sglang_server_info(state: ServerState) -> dict[str, Any]:
    """SGLang's flat `/server_info` keys a router reads (the model, its sizes, the role)."""
    cfg = state.engine.config
    return {
        "model_path": cfg.model.path,
        "tokenizer_path": cfg.model.tokenizer or cfg.model.path,
        "served_model_name": state.model_name,
        "tp_size": cfg.parallel.tp_size,
        "dp_size": 1,
        "page_size": cfg.cache.page_size,
        "context_length": state.engine.max_context_len,
        "disaggregation_mode": cfg.disaggregation.mode if cfg.disaggregation.enabled else "null",
    }


router = APIRouter()


def probe_routes() -> APIRouter:
    """The probe routes, for the app's API router to include."""
    return router


@router.get("/get_server_info")
async def get_server_info(request: Request) -> JSONResponse:
    return JSONResponse({**sglang_server_info(server_state(request)), "version": __version__})


async def model_info(request: Request) -> JSONResponse:
    state = server_state(request)
    info = sglang_server_info(state)
    return JSONResponse(
        {
            "model_path": info["model_path"],
            "tokenizer_path": info["tokenizer_path"],
            "served_model_name": state.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
    )


router.add_api_route("/model_info", model_info, methods=["GET"])
router.add_api_route("/get_model_info", model_info, methods=["GET"])


@router.get("/get_load")
async def get_load(request: Request) -> JSONResponse:
    engine = server_state(request).engine
    snap = engine.snapshot()
    pools = snap.pools
    held = pools.kv_tokens_total - pools.kv_tokens_free - pools.kv_tokens_evictable
    load = {
        "dp_rank": 0,
        "num_reqs": snap.running + snap.waiting,
        "num_waiting_reqs": snap.waiting,
        "num_tokens": max(held, 0),
    }
    return JSONResponse([load])


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    state = server_state(request)
    engine = state.engine
    up = engine.healthy and engine.accepting and not state.lifecycle.draining
    if not up:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    if state.disagg is not None:
        return JSONResponse({"status": "ok"})
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    rid = f"health-generate-{uuid.uuid4().hex}"

    async def one_token() -> list[GenerationChunk]:
        return [c async for c in engine.generate([0], params, rid)]

    try:
        got = await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except Exception:  # a probe answers 503 for any failure, never 500
        return JSONResponse({"status": "unavailable"}, status_code=503)
    if not got or got[-1].error is not None:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.post("/v1/completions/render")
async def render_completion(request: Request) -> JSONResponse:
    body = await read_body(request, CompletionRequest)
    state = open_request(body, request)
    engine, limits = state.engine, state.limits
    with converting():
        prompts = await prompt_ids_async(engine, body.prompt, limits.max_prompts_per_request)
        prompts = [
            truncated(p, body.truncate_prompt_tokens, engine.max_context_len) for p in prompts
        ]
        for ids in prompts:
            engine.validator.check_prompt(ids, body.max_tokens, param="prompt")
    tokenizer = engine.tokenizer
    return JSONResponse(
        [{"prompt": tokenizer.decode(ids), "prompt_token_ids": ids} for ids in prompts]
    )


@router.post("/v1/chat/completions/render")
async def render_chat(request: Request) -> JSONResponse:
    body = await read_body(request, ChatCompletionRequest)
    state = open_request(body, request)
    engine, limits = state.engine, state.limits
    check_chat_size(body, limits)
    plan = plan_chat(body, limits)
    with converting():
        ids = await chat_prompt_ids_async(engine, body, template_kwargs=plan.template_kwargs)
        ids = truncated(ids, body.truncate_prompt_tokens, engine.max_context_len)
        max_tokens = body.max_completion_tokens or body.max_tokens
        engine.validator.check_prompt(ids, max_tokens, param="messages")
    conversation = [m.model_dump(mode="json", exclude_none=True) for m in body.messages]
    prompt = {"prompt": engine.tokenizer.decode(ids), "prompt_token_ids": ids}
    return JSONResponse([conversation, [prompt]])
