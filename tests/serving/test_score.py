"""`/v1/score` and `/v1/rerank` on a tiny random `BertForSequenceClassification` (with
all-MiniLM-L6-v2's tokenizer), against transformers' logits through a sigmoid."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from stallfree.entrypoints.server import create_app, start_server
from stallfree.runtime.pooler import PoolingEngine, open_engine, runner_for
from tests.engine_util import engine_config
from tests.minilm import make_cross_encoder, require_minilm

QUERY = "what does a fox eat"
DOCS = [
    "Foxes eat small mammals, birds, fruit and insects.",
    "The stock market closed higher on Tuesday.",
    "A red fox hunting in the snow listens for mice under the surface before it pounces.",
]


def _expected(path: Path, pairs: list[tuple[str, str]], **truncation: Any) -> torch.Tensor:
    from transformers import AutoTokenizer, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path).eval()
    enc = tok(
        [a for a, _ in pairs],
        [b for _, b in pairs],
        padding=True,
        return_tensors="pt",
        **truncation,
    )
    with torch.inference_mode():
        return torch.sigmoid(model(**enc).logits[:, 0])


@contextlib.asynccontextmanager
async def served(path: Path) -> AsyncIterator[tuple[PoolingEngine, httpx.AsyncClient]]:
    engine = open_engine(engine_config(str(path), server={"served_model_name": "ce"}))
    assert isinstance(engine, PoolingEngine)
    server = await start_server(create_app(engine))
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    try:
        yield engine, http
    finally:
        await http.aclose()
        await server.stop()
        await engine.shutdown()


@pytest.fixture
def cross_encoder(tmp_path: Path) -> Path:
    require_minilm()
    return make_cross_encoder(tmp_path)


@pytest.mark.asyncio
async def test_score_and_rerank_equal_transformers(cross_encoder: Path) -> None:
    expected = _expected(cross_encoder, [(QUERY, d) for d in DOCS])
    assert expected.max() - expected.min() > 1e-3  # the pairs score apart
    async with served(cross_encoder) as (engine, http):
        assert engine.task == "score"
        r = await http.post("/v1/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        got = torch.tensor([d["score"] for d in body["data"]])
        assert (got - expected).abs().max().item() < 1e-5
        assert body["usage"]["prompt_tokens"] > 0
        # pairs in order
        r = await http.post(
            "/score", json={"model": "ce", "text_1": [QUERY, QUERY], "text_2": DOCS[:2]}
        )
        assert torch.allclose(torch.tensor([d["score"] for d in r.json()["data"]]), got[:2])
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            r = await http.post(
                path,
                json={
                    "model": "ce",
                    "query": QUERY,
                    "documents": [DOCS[0], {"text": DOCS[1]}, DOCS[2]],
                    "top_n": 2,
                },
            )
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            order = torch.argsort(expected, descending=True)[:2].tolist()
            assert [x["index"] for x in results] == order
            assert [x["document"]["text"] for x in results] == [DOCS[i] for i in order]
            assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert engine.counters.finished == {"stop": 5}


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/score", {"text_1": [], "text_2": DOCS}, "must not be empty"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": DOCS}, "text_1 has 2 texts"),
        ("/v1/score", {"text_1": "", "text_2": "x"}, "empty text"),
        ("/v1/score", {"text_1": 3, "text_2": "x"}, "text_1"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents must not be empty"),
        ("/v1/rerank", {"documents": DOCS}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": ["d"] * 2049}, "at most 2048"),
        ("/v1/rerank", {"query": "long " * 200, "documents": DOCS}, "over the model's limit"),
        ("/v1/embeddings", {"input": "x"}, "cross-encoder"),
        ("/v1/completions", {"prompt": "x"}, "pooling runner"),
    ],
)
@pytest.mark.asyncio
async def test_bad_input_is_a_400(cross_encoder: Path, path: str, body: dict, words: str) -> None:
    async with served(cross_encoder) as (engine, http):
        r = await http.post(path, json={"model": "ce", **body})
        assert r.status_code == 400, r.text
        assert words in r.text
        ok = await http.post("/v1/rerank", json={"model": "ce", "query": "q", "documents": ["d"]})
        assert ok.status_code == 200
        assert not engine._waiting


@pytest.mark.asyncio
async def test_truncation_cuts_a_long_pair(cross_encoder: Path) -> None:
    """Cut to the model's 128 positions, the longer text first, as transformers' tokenizer
    does with truncation="longest_first"."""
    long_doc = "the fox ran through the forest " * 40
    expected = _expected(
        cross_encoder, [(QUERY, long_doc)], truncation="longest_first", max_length=128
    )
    async with served(cross_encoder) as (_, http):
        r = await http.post(
            "/v1/rerank",
            json={
                "model": "ce",
                "query": QUERY,
                "documents": [long_doc],
                "truncate_prompt_tokens": -1,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == 128
        got = r.json()["results"][0]["relevance_score"]
        assert abs(got - expected[0].item()) < 1e-5


@pytest.mark.asyncio
async def test_an_embedder_refuses_scoring() -> None:
    path = require_minilm()
    engine = open_engine(engine_config(str(path), server={"served_model_name": "m"}))
    server = await start_server(create_app(engine))
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            r = await http.post("/v1/rerank", json={"model": "m", "query": "q", "documents": ["d"]})
            assert r.status_code == 400 and "is an embedder" in r.text
    finally:
        await server.stop()
        await engine.shutdown()


def test_a_cross_encoder_picks_the_pooling_runner(cross_encoder: Path) -> None:
    assert runner_for(engine_config(str(cross_encoder))) == "pooling"
