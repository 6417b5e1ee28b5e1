"""`/v1/embeddings` on the pooling runner with all-MiniLM-L6-v2, through the official `openai`
client, against sentence-transformers; refusals; the runner chosen from the architecture."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import torch
from openai import AsyncOpenAI

from stallfree.entrypoints.server import create_app, start_server
from stallfree.runtime.engine import Engine
from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.pooler import PoolingEngine, open_engine, runner_for
from tests.engine_util import engine_config
from tests.http_util import MODEL, ROOT, stallfree_serve
from tests.minilm import matryoshka_copy, require_minilm
from tests.server_util import module_loop

TEXTS = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, again and again, until it is tired.",
    "a",
    "Embeddings map text to vectors; similar texts land close together.",
]


@contextlib.asynccontextmanager
async def pooling_server(path: Path, **sections: Any) -> AsyncIterator[tuple[PoolingEngine, Any]]:
    sections.setdefault("server", {})["served_model_name"] = "minilm"
    engine = open_engine(engine_config(str(path), **sections))
    assert isinstance(engine, PoolingEngine)
    server = await start_server(create_app(engine))
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    try:
        yield engine, (client, http)
    finally:
        await client.close()
        await http.aclose()
        await server.stop()
        await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def minilm() -> AsyncIterator[tuple[PoolingEngine, Any]]:
    # a small batch budget, so one request's inputs span several batches
    async with pooling_server(require_minilm(), scheduler={"max_prefill_tokens": 512}) as served:
        yield served


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(require_minilm()), device="cpu")
    return torch.from_numpy(model.encode(TEXTS))


def _close(got: list[list[float]] | torch.Tensor, expected: torch.Tensor) -> None:
    ours = torch.as_tensor(got, dtype=torch.float32)
    cosine = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
    assert cosine.min().item() >= 0.9999
    assert (ours - expected).abs().max().item() < 1e-4


@module_loop
async def test_openai_client_equals_sentence_transformers(
    minilm: Any, reference: torch.Tensor
) -> None:
    engine, (client, _) = minilm
    answer = await client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    assert [d.index for d in answer.data] == [0, 1, 2, 3]
    _close([d.embedding for d in answer.data], reference)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(i) for i in ids)
    assert answer.model == "minilm"
    # the client's default asks for base64 and decodes it
    default = await client.embeddings.create(model="minilm", input=TEXTS[0])
    _close([default.data[0].embedding], reference[:1])


@module_loop
async def test_token_ids_and_base64(minilm: Any, reference: torch.Tensor) -> None:
    engine, (_, http) = minilm
    ids = [engine.tokenizer.encode(t) for t in TEXTS[:2]]
    r = await http.post("/v1/embeddings", json={"model": "minilm", "input": ids})
    assert r.status_code == 200, r.text
    _close([d["embedding"] for d in r.json()["data"]], reference[:2])
    r = await http.post(
        "/v1/embeddings", json={"model": "minilm", "input": ids[1], "encoding_format": "base64"}
    )
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    _close(torch.frombuffer(bytearray(raw), dtype=torch.float32)[None], reference[1:2])


@module_loop
async def test_many_inputs_span_batches(minilm: Any, reference: torch.Tensor) -> None:
    """More inputs than one batch holds (max_prefill_tokens): every vector in its place."""
    engine, (_, http) = minilm
    before = engine.counters.prefill_batches
    texts = TEXTS * 40  # 160 inputs of up to 21 tokens: over 3,000 padded, the budget 512
    r = await http.post("/v1/embeddings", json={"model": "minilm", "input": texts})
    assert r.status_code == 200
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(160))
    _close([d["embedding"] for d in data], reference.repeat(40, 1))
    assert engine.counters.prefill_batches - before >= 2


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["fine", ""]}, "input", "input[1] is an empty string"),
        ({"input": [[]]}, "input", "empty list of tokens"),
        ({"input": [5, 99999]}, "input", "outside the vocabulary"),
        ({"input": "word " * 300}, "input", "over the model's limit of 256"),
        ({"input": 7}, None, "input"),
        ({"input": ["a", 3]}, None, "input"),
        ({"input": "x", "encoding_format": "int8"}, None, "encoding_format"),
        ({"input": "x", "dimensions": 100}, "dimensions", "not a Matryoshka model"),
        ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or"),
        ({"input": "x", "truncate_prompt_tokens": 999}, "truncate_prompt_tokens", "over"),
        ({"input": ["x"] * 2049}, "input", "has 2049 items; one request takes at most 2048"),
    ],
)
@module_loop
async def test_bad_input_is_a_400(minilm: Any, body: dict, param: str | None, words: str) -> None:
    engine, (_, http) = minilm
    r = await http.post("/v1/embeddings", json={"model": "minilm", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
    ok = await http.post("/v1/embeddings", json={"model": "minilm", "input": "still serving"})
    assert ok.status_code == 200
    assert not engine._waiting


@module_loop
async def test_truncate_prompt_tokens_cuts_long_inputs(minilm: Any) -> None:
    st = pytest.importorskip("sentence_transformers")
    _, (_, http) = minilm
    long_text = "the river bends " * 120  # ~360 tokens, past max_seq_length (256)
    r = await http.post(
        "/v1/embeddings",
        json={"model": "minilm", "input": long_text, "truncate_prompt_tokens": -1},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 256
    # sentence-transformers cuts at max_seq_length, keeping [SEP]: the same vector
    expected = st.SentenceTransformer(str(require_minilm()), device="cpu").encode([long_text])
    _close([r.json()["data"][0]["embedding"]], torch.from_numpy(expected))


@module_loop
async def test_generation_routes_name_the_runner(minilm: Any) -> None:
    _, (client, http) = minilm
    with pytest.raises(openai.BadRequestError, match="this server runs the pooling runner"):
        await client.completions.create(model="minilm", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        await client.chat.completions.create(
            model="minilm", messages=[{"role": "user", "content": "hi"}]
        )
    r = await http.post("/generate", json={"text": "hi"})
    assert r.status_code == 400 and "pooling runner" in r.text
    assert (await http.get("/health")).status_code == 200


@pytest.mark.asyncio
async def test_generation_server_refuses_embeddings_its_model_cannot_pool(llama: str) -> None:
    """A native family's generating server embeds too (tests/engine/test_mixed_pool_generate.py);
    one whose model runs through the transformers fallback cannot pool: a 400 naming the runner
    and why."""
    sections: dict[str, Any] = {"model": {"model_impl": "transformers"}}
    engine = Engine(engine_config(llama, server={"served_model_name": "test-model"}, **sections))
    assert engine.runner == "generate" and engine.embeddings is None
    server = await start_server(create_app(engine))
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(
            openai.BadRequestError, match=r"this server runs the generate runner.*cannot pool"
        ):
            await client.embeddings.create(model="test-model", input="hi")
        assert engine.pool_usage().all_free
    finally:
        await client.close()
        await server.stop()
        await engine.shutdown()


@pytest.mark.asyncio
async def test_matryoshka_dimensions(tmp_path: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    path = matryoshka_copy(require_minilm(), tmp_path)
    model = st.SentenceTransformer(str(path), device="cpu", truncate_dim=96)
    expected = torch.from_numpy(model.encode(TEXTS, normalize_embeddings=True))
    async with pooling_server(path) as (_, (client, http)):
        answer = await client.embeddings.create(
            model="minilm", input=TEXTS, dimensions=96, encoding_format="float"
        )
        assert {len(d.embedding) for d in answer.data} == {96}
        _close([d.embedding for d in answer.data], expected)
        r = await http.post(
            "/v1/embeddings", json={"model": "minilm", "input": "x", "dimensions": 385}
        )
        assert r.status_code == 400 and "more than the model's 384" in r.text


def test_runner_from_the_architecture(llama: str) -> None:
    path = str(require_minilm())
    assert runner_for(engine_config(path)) == "pooling"
    assert runner_for(engine_config(llama)) == "generate"
    with pytest.raises(ModelLoadError, match="--runner pooling"):
        runner_for(engine_config(path, model={"runner": "generate"}))
    with pytest.raises(ModelLoadError, match="is not one"):
        runner_for(engine_config("tiny", model={"runner": "pooling"}))


def _sample(text: str, name: str) -> float:
    """The value of the sample line `name` (its labels included or left out) in `text`."""
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.asyncio
async def test_metrics_count_pooling_requests() -> None:
    """The generation engine's families count embedding requests: prompt tokens, finished
    requests, prefill batches; nothing is left running or waiting."""
    async with pooling_server(require_minilm()) as (engine, (_, http)):
        ids = [engine.tokenizer.encode(t) for t in TEXTS]
        for body in ({"input": TEXTS}, {"input": TEXTS[0]}, {"input": ""}):
            await http.post("/v1/embeddings", json={"model": "minilm", **body})
        text = (await http.get("/metrics")).text
        tokens = sum(len(i) for i in ids) + len(ids[0])
        assert engine.counters.prompt_tokens == tokens
        assert engine.counters.finished == {"stop": 2}  # the empty input never got in
        assert _sample(text, "stallfree:prompt_tokens_total") == tokens
        assert _sample(text, "stallfree:num_requests_running") == 0
        assert _sample(text, "stallfree:num_requests_waiting") == 0
        assert _sample(text, "stallfree:e2e_request_latency_seconds_count") == 2
        assert engine.pool_usage().all_free


@pytest.mark.asyncio
async def test_a_batch_is_as_large_as_its_real_tokens() -> None:
    """The batch budget counts each input's own tokens (a batch runs packed): one long and
    three short inputs that fit `max_prefill_tokens` together run as one step and count their
    tokens, not four times the longest."""
    path = require_minilm()
    engine = open_engine(engine_config(str(path), scheduler={"max_prefill_tokens": 32}))
    assert isinstance(engine, PoolingEngine)
    texts = [TEXTS[1], "a", "a", "a"]
    ids = [engine.tokenizer.encode(t) for t in texts]
    lengths = [len(i) for i in ids]
    assert sum(lengths) <= 32 < len(ids) * max(lengths)  # padded, it would not fit
    await engine.start()
    try:
        got = await engine.embed(texts)
        assert engine.counters.prefill_batches == 1
        assert engine.counters.prefill_tokens == sum(lengths)
        alone = await engine.embed([TEXTS[1]])
        assert (got.outputs[0] - alone.outputs[0]).abs().max().item() < 1e-5
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_batches_run_on_one_thread_and_the_loop_gives_up_its_openmp_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every batch runs on the engine's one pooling thread, and the event loop's thread gives
    up the OpenMP pool the model's load made (two live pools on few cores make each parallel
    region wait on a futex: the embedded API ran 10% slower, asyncio.to_thread's threads
    each making a pool of their own)."""
    import threading

    engine = open_engine(engine_config(str(require_minilm()), scheduler={"max_prefill_tokens": 8}))
    assert isinstance(engine, PoolingEngine)
    threads: list[str] = []
    real_forward = engine._forward

    def forward(*args: Any) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return real_forward(*args)

    monkeypatch.setattr(engine, "_forward", forward)
    await engine.start()
    try:
        assert torch.get_num_threads() == 1  # this thread's later regions run on itself
        await engine.embed(TEXTS)  # a budget of 8 tokens: a batch per input
        await engine.embed(["one more"])
        assert len(threads) == len(TEXTS) + 1
        assert set(threads) == {threads[0]} and threads[0].startswith("stallfree-pooling")
    finally:
        await engine.shutdown()


def test_pooling_refuses_what_it_does_not_run() -> None:
    path = str(require_minilm())
    config = engine_config(path, parallel={"tp_size": 2}, disaggregation={"mode": "decode"})
    with pytest.raises(ModelLoadError, match=r"disaggregation\.mode, parallel\.tp_size > 1"):
        open_engine(config)


@pytest.mark.asyncio
async def test_a_request_past_its_deadline_is_a_504_and_counted() -> None:
    runtime = {"request_timeout_s": 1e-9}
    async with pooling_server(require_minilm(), runtime=runtime) as (engine, (_, http)):
        r = await http.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS})
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "deadline_exceeded"
        await engine.wait_idle()
        assert engine.counters.finished == {"abort": 1}
        assert not engine._waiting
        assert (await http.get("/health")).status_code == 200


GENERATE = ("--runner", "generate", "--device", "cpu")


def test_stallfree_serve_picks_the_pooling_runner() -> None:
    """`stallfree serve MODEL` on a BertModel serves embeddings with no flag; `--runner
    generate` on it exits 2 naming the reason."""
    path = str(require_minilm())
    with stallfree_serve("--model", path) as (_, base):
        r = httpx.post(base + "/v1/embeddings", json={"model": MODEL, "input": ["a", "b"]})
        assert r.status_code == 200, r.text
        assert [len(d["embedding"]) for d in r.json()["data"]] == [384, 384]
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 400 and "pooling runner" in r.text
    done = subprocess.run(
        [sys.executable, "-m", "stallfree.entrypoints.cli", "serve", "--model", path, *GENERATE],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 2
    assert "is an encoder: it cannot generate; serve it with --runner pooling" in done.stderr


@pytest.mark.asyncio
async def test_a_failed_step_fails_its_requests_and_a_dead_loop_fails_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection: a step that raises fails its requests (the server serves on); a loop
    that dies fails the request in hand and reports unhealthy, so nothing waits forever."""
    from stallfree.runtime.request.errors import EngineUnhealthyError

    engine = open_engine(engine_config(str(require_minilm())))
    assert isinstance(engine, PoolingEngine)
    await engine.start()
    try:
        real_forward = engine._forward

        def failing_forward(*args: Any) -> torch.Tensor:
            raise RuntimeError("injected step failure")

        monkeypatch.setattr(engine, "_forward", failing_forward)
        with pytest.raises(EngineUnhealthyError, match="injected step failure"):
            await engine.embed(["one", "two"])
        assert engine.counters.step_failures == 1
        monkeypatch.setattr(engine, "_forward", real_forward)
        assert (await engine.embed(["fine"])).outputs.shape == (1, 384)

        def dying_deliver(*args: Any) -> None:
            raise RuntimeError("injected loop bug")

        monkeypatch.setattr(engine, "_deliver", dying_deliver)
        with pytest.raises(EngineUnhealthyError, match="injected loop bug"):
            await asyncio.wait_for(engine.embed(["lost"]), timeout=30)
        assert not engine.healthy
        assert engine.counters.finished == {"error": 2, "stop": 1}
    finally:
        await engine.shutdown()


@module_loop
async def test_vllm_pooling_route(minilm: Any, reference: torch.Tensor) -> None:
    """vLLM's /pooling: the same vectors in vLLM's shape."""
    _, (_, http) = minilm
    r = await http.post("/pooling", json={"model": "minilm", "input": TEXTS[:2]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    _close([d["data"] for d in body["data"]], reference[:2])
    r = await http.post("/pooling", json={"model": "minilm", "input": []})
    assert r.status_code == 400 and "must not be empty" in r.text


def test_override_pooler_config_flag() -> None:
    """vLLM's flag and its alias fill model.override_pooler_config; a bad one exits 2."""
    from stallfree.cli import build_parser
    from stallfree.entrypoints.cli import config_from_args

    flag = '{"pooling_type": "cls", "normalize": false}'
    for name in ("--override-pooler-config", "--pooler-config"):
        args = build_parser().parse_args(["serve", "--model", "x", name, flag])
        config = config_from_args(args)
        assert config.model.override_pooler_config == {"pooling_type": "CLS", "normalize": False}
    for bad, words in (
        ("{", "not a JSON object"),
        ('{"pooling_type": "SUM"}', "pooling_type 'SUM' is not one of"),
        ('{"normalise": true}', "unknown pooler setting(s) normalise"),
        ('{"normalize": "yes"}', "normalize is true or false"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "stallfree.cli", "serve", "--override-pooler-config", bad],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        assert done.returncode == 2, done.stderr
        assert words in done.stderr


@pytest.mark.asyncio
async def test_override_pooler_config_changes_the_pooling() -> None:
    """CLS and no normalisation over the checkpoint's mean and Normalize: transformers'
    [CLS] hidden state as it comes."""
    from transformers import AutoModel, AutoTokenizer

    path = require_minilm()
    override = {"override_pooler_config": {"pooling_type": "CLS", "normalize": False}}
    engine = open_engine(engine_config(str(path), model=override))
    assert isinstance(engine, PoolingEngine)
    assert (engine.pooling.mode, engine.pooling.normalize) == ("cls", False)
    await engine.start()
    try:
        ours = (await engine.embed(TEXTS)).outputs
    finally:
        await engine.shutdown()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.inference_mode():
        hidden = AutoModel.from_pretrained(path)(**tok(TEXTS, padding=True, return_tensors="pt"))
    expected = hidden.last_hidden_state[:, 0]
    assert (ours - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("how", ["abort_requests", "grace_period_ends"])
@pytest.mark.asyncio
async def test_an_admitted_pooling_request_can_be_ended(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """vLLM's /abort_requests names an embeddings request by its X-Request-Id (a 503
    'aborted'), and the end of the drain's grace period ends it (the shutdown's 503); either
    is counted as abort and the engine serves on. The step is held at a gate (fault
    injection) so the end lands while the request is in flight."""
    import threading

    engine = open_engine(engine_config(str(require_minilm()), server={"served_model_name": "m"}))
    assert isinstance(engine, PoolingEngine)
    server = await start_server(create_app(engine))
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    gate = threading.Event()
    try:
        real_forward = engine._forward

        def gated_forward(*args: Any) -> torch.Tensor:
            gate.wait(30)
            return real_forward(*args)

        monkeypatch.setattr(engine, "_forward", gated_forward)
        headers = {"x-request-id": "embed-me"}
        body = {"model": "m", "input": TEXTS}
        held = asyncio.create_task(http.post("/v1/embeddings", json=body, headers=headers))
        while "embed-me" not in engine._live:
            await asyncio.sleep(0.01)
        if how == "abort_requests":
            r = await http.post("/abort_requests", json={"request_ids": ["embed-me"]})
            assert r.json() == {"aborted": 1}
        else:
            assert server.server.sf.lifecycle.expire() == 1
        answer = await held
        gate.set()
        assert answer.status_code == 503, answer.text
        code = answer.json()["error"].get("code")
        assert (code == "aborted") == (how == "abort_requests")
        await engine.wait_idle()
        assert engine.counters.finished == {"abort": 1}
        assert not engine._live and not engine._waiting
        assert not server.server.sf.lifecycle.admitted
        if how == "abort_requests":
            ok = await http.post("/v1/embeddings", json=body)
            assert ok.status_code == 200
            assert engine.counters.finished == {"abort": 1, "stop": 1}
    finally:
        gate.set()
        await http.aclose()
        await server.stop()
        await engine.shutdown()
