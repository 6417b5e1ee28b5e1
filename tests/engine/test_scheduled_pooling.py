"""A decoder embedder's requests through the scheduler (`ScheduledPoolingEngine`): prefill-only
requests, chunked when long and batched with each other, in every overlap x mirrors mode (with
mixed steps on, which pooling rows never join). Their pooled vectors equal transformers'
final hidden states pooled the same way; the counters count them; every pool is back to full."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from stallfree.entrypoints.server import create_app, start_server
from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.pooler import open_engine
from stallfree.runtime.request.errors import EngineUnhealthyError, InvalidRequestError
from stallfree.runtime.scheduled_pooler import ScheduledPoolingEngine
from tests.engine_util import MODES, engine_config, guarded, random_prompts
from tests.hf_models import make_qwen3

LONG = random_prompts(2, seed=11, lo=40, hi=50)  # three or more chunks of 16 each
SHORT = random_prompts(4, seed=12, lo=3, hi=12)
SCHED = {"chunked_prefill_size": 16, "max_prefill_tokens": 24, "enable_mixed_chunk": True}


def _reference(path: Path, rows: list[list[int]], mode: str) -> torch.Tensor:
    """transformers' final hidden states of each row alone, pooled by `mode`, unnormalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for row in rows:
            h = model(input_ids=torch.tensor([row])).last_hidden_state[0]
            out.append(h[-1] if mode == "last" else h.mean(dim=0))
    return torch.stack(out)


def _open(path: Path, overlap: bool, mirrors: bool, **model: Any) -> ScheduledPoolingEngine:
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    cfg = engine_config(
        str(path), model={"runner": "pooling", **model}, runtime=runtime, scheduler=SCHED
    )
    engine = open_engine(cfg)
    assert isinstance(engine, ScheduledPoolingEngine)
    guarded(engine)
    return engine


def _record_steps(engine: ScheduledPoolingEngine) -> list[tuple[list[str], list[int], int]]:
    steps: list[tuple[list[str], list[int], int]] = []
    runner = engine.core.runner
    launch = runner.launch

    def spy(step: Any, seq: int) -> Any:
        fb = step.forward_batch
        steps.append(([r.rid for r in step.reqs], list(fb.extend_lens_cpu), step.mixed_rows))
        return launch(step, seq)

    runner.launch = spy  # type: ignore[method-assign]
    return steps


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("embedder"))


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["last", "mean"])
@pytest.mark.parametrize("overlap,mirrors", MODES)
async def test_pooled_vectors_through_the_scheduler_equal_transformers(
    qwen3: Path, mode: str, overlap: bool, mirrors: bool
) -> None:
    override = {"pooling_type": mode.upper(), "normalize": False}
    engine = _open(qwen3, overlap, mirrors, override_pooler_config=override)
    rows = LONG + SHORT
    await engine.start()
    try:
        steps = _record_steps(engine)
        # three calls at once: their inputs share steps
        calls = [
            engine.embed(LONG[:1]),
            engine.embed([LONG[1], *SHORT[:2]]),
            engine.embed(SHORT[2:]),
        ]
        results = await asyncio.gather(*calls)
        await engine.wait_idle()
        ours = torch.cat([r.outputs for r in results])
        assert (ours - _reference(qwen3, rows, mode)).abs().max().item() < 1e-4
        assert [r.prompt_tokens for r in results] == [
            len(LONG[0]),
            len(LONG[1]) + len(SHORT[0]) + len(SHORT[1]),
            len(SHORT[2]) + len(SHORT[3]),
        ]
        # the long inputs ran in chunks, some steps carried several requests, none mixed
        long_rid = "embd-0#0"
        chunks = [lens[ids.index(long_rid)] for ids, lens, _ in steps if long_rid in ids]
        assert len(chunks) >= 3 and sum(chunks) == len(LONG[0])
        assert any(len(ids) > 1 for ids, _, _ in steps)
        assert all(mixed == 0 for _, _, mixed in steps)
        counters = engine.snapshot().counters
        assert counters.prompt_tokens == sum(len(r) for r in rows)
        assert counters.prefill_tokens == sum(len(r) for r in rows)
        assert counters.finished == {"stop": len(rows)}
        assert counters.generation_tokens == 0
        assert engine.pool_usage().all_free
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_normalised_last_token_is_the_default(qwen3: Path) -> None:
    engine = _open(qwen3, True, True)
    await engine.start()
    try:
        ours = (await engine.embed(LONG + SHORT)).outputs
    finally:
        await engine.shutdown()
    expected = torch.nn.functional.normalize(_reference(qwen3, LONG + SHORT, "last"), dim=-1)
    assert (ours - expected).abs().max().item() < 1e-4


@pytest.mark.asyncio
async def test_over_the_context_is_refused_unless_truncated(qwen3: Path) -> None:
    engine = _open(qwen3, True, True, max_context_len=32)
    await engine.start()
    try:
        with pytest.raises(InvalidRequestError, match="32"):
            await engine.embed([LONG[0]])
        cut = await engine.embed([LONG[0]], truncate_prompt_tokens=32)
        whole = await engine.embed([LONG[0][:32]])  # as long as the context: accepted
        assert cut.prompt_tokens == 32 == whole.prompt_tokens
        assert engine.snapshot().counters.finished == {"stop": 2}
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_generation_and_scoring_are_refused(qwen3: Path) -> None:
    engine = _open(qwen3, True, True)
    await engine.start()
    try:
        with pytest.raises(InvalidRequestError, match="pooling runner"):
            await engine.complete([1, 2, 3])
        with pytest.raises(InvalidRequestError, match="cross-encoder"):
            await engine.score([("a", "b")])
        assert engine.pool_usage().all_free
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_a_deadline_or_an_abort_frees_every_pool(qwen3: Path) -> None:
    engine = _open(qwen3, True, True)
    await engine.start()
    try:
        with pytest.raises(TimeoutError):
            await engine.embed(LONG, timeout=1e-9)
        task = asyncio.ensure_future(engine.embed(LONG, rid="gone"))
        await asyncio.sleep(0)
        assert engine.abort("gone")
        with pytest.raises(Exception, match="aborted"):
            await task
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        assert engine.snapshot().counters.finished == {"abort": 4}
        assert (await engine.embed(SHORT[:1])).outputs.shape == (1, 64)
    finally:
        await engine.shutdown()


def test_a_checkpoint_asking_max_pooling_is_refused(tmp_path: Path) -> None:
    path = make_qwen3(tmp_path)
    (path / "modules.json").write_text(
        json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling", "type": "x.Pooling"}])
    )
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_max_tokens": True})
    )
    with pytest.raises(ModelLoadError, match="max pooling"):
        open_engine(engine_config(str(path), model={"runner": "pooling"}))


@pytest.mark.asyncio
async def test_served_embeddings_route_through_the_scheduler(qwen3: Path) -> None:
    """`/v1/embeddings` of a Qwen3-shaped embedder: the scheduled runner answers, its
    counters count each input, a refusal leaks nothing, every pool ends full."""
    engine = _open(qwen3, True, True, max_context_len=48)
    server = await start_server(create_app(engine))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            body = {"model": name, "input": [LONG[0][:40], SHORT[0]]}
            r = await http.post("/v1/embeddings", json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            assert [len(d["embedding"]) for d in data["data"]] == [64, 64]
            assert data["usage"]["prompt_tokens"] == 40 + len(SHORT[0])
            too_long = {"model": name, "input": [list(range(60))]}
            r = await http.post("/v1/embeddings", json=too_long)
            assert r.status_code == 400
            r = await http.post("/v1/completions", json={"model": name, "prompt": "hi"})
            assert r.status_code == 400 and "pooling runner" in r.text
        await engine.wait_idle()
        assert engine.snapshot().counters.finished == {"stop": 2}
        assert engine.pool_usage().all_free
    finally:
        await server.stop()
        await engine.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["fail_step_rate", "fail_copy_rate"])
async def test_a_failed_pooling_step_fails_its_inputs_alone(qwen3: Path, kind: str) -> None:
    """Injected step failures: the calls whose inputs were in a failed step fail (a 500's
    error, naming the failure); the others' vectors are exact; every pool ends full."""
    rows = random_prompts(12, seed=13, lo=10, hi=40)
    cfg = engine_config(
        str(qwen3),
        model={"runner": "pooling", "override_pooler_config": {"normalize": False}},
        runtime={"max_consecutive_step_failures": 1000},
        scheduler=SCHED,
        faults={"enabled": True, "seed": 5, kind: 0.3},
    )
    engine = open_engine(cfg)
    assert isinstance(engine, ScheduledPoolingEngine)
    await engine.start()
    try:
        results = await asyncio.gather(
            *(engine.embed([row]) for row in rows), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and len(failed) < len(rows)
        assert all(isinstance(e, EngineUnhealthyError) and "injected" in str(e) for e in failed)
        expected = _reference(qwen3, rows, "last")
        for i, r in enumerate(results):
            if not isinstance(r, BaseException):
                assert (r.outputs[0] - expected[i]).abs().max().item() < 1e-4
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        assert engine.healthy
    finally:
        await engine.shutdown()
