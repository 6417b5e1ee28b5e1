"""The bench's `openai-embeddings` backend against a live pooling server (all-MiniLM-L6-v2):
every request counted with the tokens the server reports; a refused one is a failure."""

from __future__ import annotations

import pytest

from stallfree.bench.flags import BACKENDS, ENDPOINTS
from stallfree.bench.http_targets import EmbeddingsHttpTarget, http_target
from stallfree.bench.results import summarize
from stallfree.bench.targets import RequestOptions
from stallfree.bench.workloads import BenchRequest
from stallfree.entrypoints.server import create_app, start_server
from stallfree.runtime.pooler import open_engine
from tests.engine_util import engine_config
from tests.minilm import require_minilm


def test_the_backend_is_a_flag_and_an_endpoint() -> None:
    assert "openai-embeddings" in BACKENDS
    assert ENDPOINTS["/v1/embeddings"] == "openai-embeddings"


@pytest.mark.asyncio
async def test_embeddings_target_counts_requests_and_tokens() -> None:
    engine = open_engine(
        engine_config(str(require_minilm()), server={"served_model_name": "minilm"})
    )
    server = await start_server(create_app(engine))
    target = http_target("openai-embeddings", server.url)
    assert isinstance(target, EmbeddingsHttpTarget)
    try:
        await target.start()
        assert target.model == "minilm"  # the server's first model
        prompts = ["a short one", "a somewhat longer sentence to embed", [101, 7592, 102], ""]
        records = [await target.send(BenchRequest(p, 0, 0), RequestOptions()) for p in prompts]
        await target.stop()
    finally:
        await server.stop()
        await engine.shutdown()
    assert [r.success for r in records] == [True, True, True, False]
    assert records[3].error is not None and records[3].error.startswith("HTTP 400")
    expected = [len(engine.tokenizer.encode(p)) for p in prompts[:2]] + [3]
    assert [r.input_tokens for r in records[:3]] == expected
    assert all(r.output_tokens == 0 and r.ttft is not None for r in records[:3])
    summary = summarize(records, duration=2.0, peak=1)
    assert (summary.completed, summary.failed) == (3, 1)
    assert summary.total_input_tokens == sum(expected)
    assert summary.request_throughput == 1.5
    assert summary.total_output_tokens == 0
