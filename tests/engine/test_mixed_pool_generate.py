"""Generation and embedding traffic on one generating engine (a native decoder family): each
embedding input is a prefill-only pooling request on the same scheduler. Steps never mix the
two kinds (nor pooling rows with decode rows, mixed steps on); greedy outputs equal the same
engine's without embedding traffic; vectors equal transformers' pooled hidden states; pooling
requests neither use nor feed the prefix cache; every pool ends full, in every overlap x
mirrors mode."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from stallfree.entrypoints.server import create_app, start_server
from stallfree.runtime.engine import Engine
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.request.errors import InvalidRequestError
from stallfree.runtime.request.sampling_params import SamplingParams
from tests.engine.test_scheduled_pooling import LONG, SHORT, _reference
from tests.engine_util import MODES, engine_config, guarded, random_prompts
from tests.hf_models import make_qwen3

GEN = random_prompts(4, seed=21, lo=5, hi=30)
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SCHED = {"chunked_prefill_size": 16, "max_prefill_tokens": 24, "enable_mixed_chunk": True}
MEAN = {"override_pooler_config": {"pooling_type": "MEAN", "normalize": False}}


@dataclass
class Step:
    rids: list[str]
    kinds: set[bool]  # True: a pooling row
    mode: ForwardMode
    mixed_rows: int


def _record_steps(engine: Engine) -> list[Step]:
    """Every step the engine launches, with its rows' kinds."""
    steps: list[Step] = []
    runner = engine.core.runner
    launch = runner.launch

    def spy(step: Any, seq: int) -> Any:
        reqs = step.reqs
        kinds = {r.pooling is not None for r in reqs}
        steps.append(Step([r.rid for r in reqs], kinds, step.forward_batch.mode, step.mixed_rows))
        return launch(step, seq)

    runner.launch = spy  # type: ignore[method-assign]
    return steps


def _open(path: Path, overlap: bool, mirrors: bool, **sections: Any) -> Engine:
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    sections.setdefault("scheduler", SCHED)
    engine = Engine(engine_config(str(path), runtime=runtime, **sections))
    assert engine.runner == "generate" and engine.embeddings is not None
    return guarded(engine)


async def _generate(engine: Engine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    calls = (engine.complete(p, GREEDY, rid=f"{tag}{i}") for i, p in enumerate(prompts))
    results = await asyncio.gather(*calls)
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


async def _queued(call: Any) -> asyncio.Future[Any]:
    """`call` started, its requests queued, before the next one is (a few loop turns)."""
    task = asyncio.ensure_future(call)
    for _ in range(3):
        await asyncio.sleep(0)
    return task


def _first_step(steps: list[Step], rid: str) -> int:
    return next(i for i, s in enumerate(steps) if rid in s.rids)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("mixed"))


@pytest.fixture(scope="module")
def mean_reference(qwen3: Path) -> torch.Tensor:
    return _reference(qwen3, LONG + SHORT, "mean")


@pytest.mark.asyncio
@pytest.mark.parametrize("overlap,mirrors", MODES)
async def test_generation_and_embeddings_share_the_engine_in_steps_of_one_kind(
    qwen3: Path, mean_reference: torch.Tensor, overlap: bool, mirrors: bool
) -> None:
    engine = _open(qwen3, overlap, mirrors, model=MEAN)
    await engine.start()
    try:
        alone = await _generate(engine, GEN, "alone")
        await engine.wait_idle()
        assert engine.flush_cache()
        steps = _record_steps(engine)
        # arrivals interleave the kinds: generation, embeddings, generation, ...
        embeds = [([LONG[0]], "e0"), ([LONG[1], SHORT[0]], "e1"), (SHORT[1:], "e2")]
        calls: list[asyncio.Future[Any]] = []
        for i, (rows, rid) in enumerate(embeds):
            calls.append(await _queued(_generate(engine, GEN[i : i + 1], f"g{i}-")))
            calls.append(await _queued(engine.embed(rows, rid=rid)))
        calls.append(await _queued(_generate(engine, GEN[3:], "g3-")))
        results = await asyncio.gather(*calls)
        await engine.wait_idle()
        outputs = [out for r in results[0::2] for out in r]
        assert outputs == alone
        vectors = torch.cat([r.outputs for r in results[1::2]])
        assert (vectors - mean_reference).abs().max().item() < 1e-4
        # no step mixes kinds; pooling rows run in extend steps with no decode rows
        assert all(len(s.kinds) == 1 for s in steps)
        pooling = [s for s in steps if s.kinds == {True}]
        assert pooling and all(s.mode is ForwardMode.EXTEND and not s.mixed_rows for s in pooling)
        assert len([s for s in pooling if "e0#0" in s.rids]) >= 3  # chunked: 40+ tokens by 16
        # each kind is admitted in its arrival order
        gen_rids = [f"g{i}-0" for i in range(4)]
        embed_rids = ["e0#0", "e1#0", "e1#1", *[f"e2#{i}" for i in range(len(SHORT) - 1)]]
        for rids in (gen_rids, embed_rids):
            firsts = [_first_step(steps, rid) for rid in rids]
            assert firsts == sorted(firsts)
        counters = engine.snapshot().counters
        assert counters.finished == {"length": 2 * len(GEN), "stop": len(embed_rids)}
        assert engine.pool_usage().all_free
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_embeddings_default_to_the_normalised_last_token(qwen3: Path) -> None:
    engine = _open(qwen3, True, True)
    await engine.start()
    try:
        ours = (await engine.embed(LONG + SHORT)).outputs
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    finally:
        await engine.shutdown()
    expected = torch.nn.functional.normalize(_reference(qwen3, LONG + SHORT, "last"), dim=-1)
    assert (ours - expected).abs().max().item() < 1e-4


@pytest.mark.asyncio
async def test_pooling_requests_neither_use_nor_feed_the_prefix_cache(qwen3: Path) -> None:
    """A generation prompt that shares 32 tokens with an embedding input: neither is served
    from the other's KV (one after the other, and at once); generation still caches."""
    shared = LONG[0][:32]
    prompt = [*shared, 7, 8, 9]
    source = [*shared, *LONG[1][:10]]
    expected = _reference(qwen3, [source], "mean")
    engine = _open(qwen3, True, True, model=MEAN, cache={"page_size": 4, "prefix_caching": True})
    await engine.start()
    try:
        # the embedding first: its pages are not cached, so the prompt finds nothing
        first = (await engine.embed([source])).outputs
        await engine.wait_idle()
        assert engine.pool_usage().kv_tokens_cached == 0
        alone = await _generate(engine, [prompt], "after-embed")
        counters = engine.snapshot().counters
        assert counters.prefix_cache_hits == 0
        await engine.wait_idle()
        cached = engine.pool_usage().kv_tokens_cached
        assert cached >= 32  # generation still feeds the cache
        # the generation first: the embedding does not start after its cached prefix
        second = (await engine.embed([source])).outputs
        await engine.wait_idle()
        assert engine.snapshot().counters.prefix_cache_hits == 0
        assert engine.pool_usage().kv_tokens_cached == cached
        # both at once, cache flushed: the prompt neither waits for nor reads the embedding's
        assert engine.flush_cache()
        both = await asyncio.gather(engine.embed([source]), _generate(engine, [prompt], "both"))
        await engine.wait_idle()
        assert engine.snapshot().counters.prefix_cache_hits == 0
        assert both[1] == alone
        for vector in (first, second, both[0].outputs):
            assert (vector - expected).abs().max().item() < 1e-4
        assert engine.pool_usage().all_free
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_a_model_that_cannot_pool_refuses_embeddings_naming_the_runner(
    tmp_path: Path,
) -> None:
    path = make_qwen3(tmp_path)
    engine = Engine(engine_config(str(path), model={"model_impl": "transformers"}))
    assert engine.embeddings is None
    await engine.start()
    try:
        with pytest.raises(InvalidRequestError, match=r"generate runner.*cannot pool"):
            await engine.embed(SHORT[:1])
        assert engine.pool_usage().all_free
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_one_server_answers_chat_and_embeddings(qwen3: Path) -> None:
    engine = _open(qwen3, True, True, server={"served_model_name": "m"})
    server = await start_server(create_app(engine))
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "ignore_eos": True,
    }
    embed = {"model": "m", "input": [LONG[0], SHORT[0]]}
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            answers = await asyncio.gather(
                http.post("/v1/chat/completions", json=chat),
                http.post("/v1/embeddings", json=embed),
                http.post("/v1/chat/completions", json=chat),
                http.post("/v1/embeddings", json={"model": "m", "input": "some text to embed"}),
            )
            for r in answers:
                assert r.status_code == 200, r.text
            assert answers[0].json()["usage"]["completion_tokens"] == 6
            data = answers[1].json()["data"]
            assert [len(d["embedding"]) for d in data] == [64, 64]
            vectors = torch.tensor([d["embedding"] for d in data])
            expected = _reference(qwen3, [LONG[0], SHORT[0]], "last")
            expected = torch.nn.functional.normalize(expected, dim=-1)
            assert (vectors - expected).abs().max().item() < 1e-4
            assert len(answers[3].json()["data"]) == 1
            too_long = {"model": "m", "input": [[1] * 2000]}  # over the 1024-token context
            assert (await http.post("/v1/embeddings", json=too_long)).status_code == 400
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    finally:
        await server.stop()
        await engine.shutdown()


@pytest.mark.asyncio
async def test_embeddings_beside_lora_generation_run_on_the_base_model(
    llama: str, tmp_path: Path
) -> None:
    """Adapters in use by generation rows never reach a pooling step's rows: the vectors equal
    the base model's hidden states."""
    from tests.lora.test_lora_engine import NAMES, lora_config
    from tests.lora_models import ADAPTERS, make_adapter

    adapters = {
        name: str(make_adapter(llama, tmp_path / name, seed=i, **cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    cfg = lora_config(llama, adapters, scheduler=SCHED, model=MEAN)
    engine = guarded(Engine(cfg))
    assert engine.embeddings is not None and engine.lora is not None
    await engine.start()
    try:
        gens = [
            engine.complete(p, GREEDY, lora_name=NAMES[i % len(NAMES)]) for i, p in enumerate(GEN)
        ]
        results = await asyncio.gather(engine.embed(LONG + SHORT), *gens)
        assert all(r.error is None for r in results[1:])
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    finally:
        await engine.shutdown()
    expected = _reference(Path(llama), LONG + SHORT, "mean")
    assert (results[0].outputs - expected).abs().max().item() < 1e-4
