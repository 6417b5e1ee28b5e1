"""The waiting-queue limit counts every input of a pooling call (issue 43): an embeddings,
score or rerank call of n inputs queues n requests, so it is refused whole, with the
overloaded 503, when they would take the waiting queue past `scheduler.max_waiting_requests`,
and with a 400 naming the limit when n alone is over it (no retry could fit it); nothing of
it is queued, and a call that fits is served. On the generate engine (each input a
scheduled request) and on the pooling runner (BERT embedder and cross-encoder)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import httpx
import pytest

from stallfree.entrypoints.server import create_app, start_server
from stallfree.runtime.engine import Engine
from stallfree.runtime.pooled import Pooled
from stallfree.runtime.pooler import PoolingEngine, open_engine
from stallfree.runtime.request.errors import EngineOverloadedError
from stallfree.runtime.scheduling.sizing import waiting_limit
from stallfree.runtime.text.pooling_inputs import MAX_INPUTS
from tests.engine_util import engine_config
from tests.hf_models import make_qwen3
from tests.minilm import make_cross_encoder, make_embedder

LIMIT = 4
TEXTS = ["one", "two words", "three words here", "a fourth, longer input text", "five"]


def _refusal(inputs: int, waiting: int) -> str:
    return (
        f"this call's {inputs} inputs would take the waiting queue past its limit of "
        f"{LIMIT} requests ({waiting} waiting)"
    )


@contextlib.asynccontextmanager
async def _served(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    server = await start_server(create_app(engine))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            yield http
    finally:
        await server.stop()
        await engine.shutdown()


def _config(path: Path, **sections: Any) -> Any:
    return engine_config(
        str(path),
        server={"served_model_name": "m"},
        scheduler={"max_waiting_requests": LIMIT},
        **sections,
    )


def _assert_too_many(r: httpx.Response, inputs: int) -> None:
    """More inputs than the whole queue holds: a 400 (retrying would never fit), not a 503."""
    assert r.status_code == 400, r.text[:300]
    assert "retry-after" not in r.headers
    error = r.json()["error"]
    assert error["code"] == "too_many_inputs" and error["param"] == "input"
    assert (
        f"this call has {inputs} inputs, more than the waiting queue holds ({LIMIT}"
        in (error["message"])
    )
    assert f"send at most {LIMIT} inputs per call" in error["message"]


async def _two_then_three(engine: Engine) -> tuple[Pooled, BaseException | Pooled]:
    """A call of 2 inputs and one of 3 started in one loop turn: the second finds the first's
    2 inputs waiting (the engine's loop runs after both)."""
    calls: list[Awaitable[Pooled]] = [engine.embed(TEXTS[:2]), engine.embed(TEXTS[2:])]
    first, second = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(first, Pooled), first
    return first, second


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("queue-limit"))


@pytest.mark.asyncio
async def test_generate_engine_embeddings_count_each_input_against_the_queue(
    qwen3: Path,
) -> None:
    engine = Engine(_config(qwen3))
    assert engine.embeddings is not None
    async with _served(engine) as http:
        r = await http.post("/v1/embeddings", json={"model": "m", "input": TEXTS})
        _assert_too_many(r, len(TEXTS))
        assert engine.snapshot().waiting == 0 and len(engine.requests) == 0
        assert engine.snapshot().counters.finished == {}
        assert engine.pool_usage().all_free
        fits = await http.post("/v1/embeddings", json={"model": "m", "input": TEXTS[:LIMIT]})
        assert fits.status_code == 200, fits.text[:300]
        assert [d["index"] for d in fits.json()["data"]] == list(range(LIMIT))
        first, second = await _two_then_three(engine)
        assert isinstance(second, EngineOverloadedError)
        assert str(second) == _refusal(3, 2)
        assert first.outputs.shape[0] == 2
        await engine.wait_idle()
        assert engine.snapshot().counters.finished == {
            "stop": LIMIT + 2
        }  # no input of a refused call
        assert len(engine.requests) == 0 and not engine.embeddings.groups
        assert engine.pool_usage().all_free


@pytest.mark.asyncio
async def test_pooling_runner_embeddings_count_each_input_against_the_queue(
    tmp_path: Path,
) -> None:
    engine = open_engine(_config(make_embedder(tmp_path)))
    assert isinstance(engine, PoolingEngine)
    async with _served(engine) as http:
        for route in ("/v1/embeddings", "/pooling"):
            r = await http.post(route, json={"model": "m", "input": TEXTS})
            _assert_too_many(r, len(TEXTS))
            assert engine.snapshot().waiting == 0 and not engine._live
        fits = await http.post("/v1/embeddings", json={"model": "m", "input": TEXTS[:LIMIT]})
        assert fits.status_code == 200, fits.text[:300]
        assert len(fits.json()["data"]) == LIMIT
        first, second = await _two_then_three(engine)
        assert isinstance(second, EngineOverloadedError)
        assert str(second) == _refusal(3, 2)
        assert first.outputs.shape[0] == 2
        await engine.wait_idle()
        assert engine.counters.finished == {"stop": 2}  # the refused calls never counted
        served = fits.json()["usage"]["prompt_tokens"] + first.prompt_tokens
        assert engine.counters.prompt_tokens == served  # not a token of the refused calls
        assert not engine._waiting and not engine._live
        assert engine.pool_usage().all_free


@pytest.mark.asyncio
async def test_score_and_rerank_count_each_pair_against_the_queue(tmp_path: Path) -> None:
    engine = open_engine(_config(make_cross_encoder(tmp_path)))
    assert isinstance(engine, PoolingEngine) and engine.task == "score"
    docs = TEXTS
    async with _served(engine) as http:
        score = {"model": "m", "text_1": "query", "text_2": docs}
        rerank = {"model": "m", "query": "query", "documents": docs}
        for route, body in (("/v1/score", score), ("/v1/rerank", rerank)):
            _assert_too_many(await http.post(route, json=body), len(docs))
            assert engine.snapshot().waiting == 0 and not engine._live
        fits = await http.post("/v1/rerank", json=rerank | {"documents": docs[:LIMIT]})
        assert fits.status_code == 200, fits.text[:300]
        assert len(fits.json()["results"]) == LIMIT
        await engine.wait_idle()
        assert engine.counters.finished == {"stop": 1}
        assert engine.pool_usage().all_free


@pytest.mark.asyncio
async def test_the_encoders_default_queue_takes_a_call_of_openais_most_inputs(
    tmp_path: Path,
) -> None:
    """Without `scheduler.max_waiting_requests` the encoder's queue holds two calls of 2,048
    inputs (OpenAI's most per call), so a client batching to that limit is served; the
    scheduler's own default (4 per request slot, 1,024) would have refused it with a 400."""
    engine = open_engine(
        engine_config(str(make_embedder(tmp_path)), server={"served_model_name": "m"})
    )
    assert isinstance(engine, PoolingEngine)
    assert engine.max_waiting_requests == 2 * MAX_INPUTS > waiting_limit(engine.config)
    async with _served(engine) as http:
        texts = [f"text number {i}" for i in range(MAX_INPUTS)]
        r = await http.post("/v1/embeddings", json={"model": "m", "input": texts})
        assert r.status_code == 200, r.text[:300]
        assert [d["index"] for d in r.json()["data"]] == list(range(MAX_INPUTS))
        assert engine.pool_usage().all_free
