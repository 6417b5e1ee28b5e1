"""The engine at tp_size=2 (two gloo worker processes): greedy output equals transformers and
tp_size=1 in all four overlap × mirrors modes, pools drain, per-rank figures, fail-closed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from stallfree import Engine, SamplingParams
from stallfree.overlap.process_stream import ProcessStream
from tests.engine_util import MODES, engine_config, guarded, random_prompts
from tests.hf_models import hf_greedy, make_llama, make_qwen2

pytestmark = pytest.mark.slow  # every test here is over ~5 s (see pyproject)

NEW_TOKENS = 10
PROMPTS = random_prompts(4, seed=21, lo=4, hi=28)
STRESSED = {
    # page size 4, prefill chunks of 7 and a pool small enough to retract
    "cache": {"page_size": 4, "max_total_tokens": 64, "max_running_requests": 4},
    "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
}

MODELS = {
    # 2 KV heads split over the two ranks
    "llama-kv2": (make_llama, {}),
    # 1 KV head replicated on both ranks, tied embeddings
    "qwen2-kv1-tied": (make_qwen2, {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_reference(request, tmp_path_factory):
    make, overrides = MODELS[request.param]
    path = make(tmp_path_factory.mktemp(request.param), **overrides)
    return str(path), [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]


async def _settled_snapshot(engine: Engine):
    """Rank 0 answers a step before the other ranks have counted it: wait until they have."""
    deadline = time.monotonic() + 5
    while True:
        snap = engine.snapshot()
        steps = snap.counters.steps
        if all(w.steps == steps for w in snap.workers) or time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.01)


def _params() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_tp2_greedy_equals_transformers(model_and_reference, overlap, mirrors):
    path, reference = model_and_reference
    cfg = engine_config(
        path,
        runtime={"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors},
        parallel={"tp_size": 2},
        **STRESSED,
    )
    engine = guarded(Engine(cfg))
    stream = engine.core.stream
    assert isinstance(stream, ProcessStream) and len(stream.processes) == 2
    async with engine:
        results = await asyncio.gather(*(engine.complete(p, _params()) for p in PROMPTS))
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        snap = await _settled_snapshot(engine)
        monitor = engine.core.monitor
    assert [r.token_ids for r in results] == reference
    assert snap.counters.retractions > 0
    assert [w.rank for w in snap.workers] == [0, 1]
    for w in snap.workers:
        assert w.steps == snap.counters.steps  # every rank ran every step
        assert w.comm_seconds > 0 and w.comm_bytes > 0
    assert snap.workers[0].comm_bytes == snap.workers[1].comm_bytes
    assert all(not p.is_alive() for p in stream.processes)  # shutdown joined both ranks
    if mirrors:
        assert monitor.total_stalls() == 0
    else:
        assert monitor.stall_counts["schedule.page_count"] > 0


async def test_tp2_in_process_and_process_workers_agree_on_sampling(model_and_reference):
    """Seeded sampling and logprobs: both ranks sample the same token from the gathered logits,
    so each feeds its own future map the token rank 0 returns."""
    path, _ = model_and_reference
    params = [
        SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=3, logprobs=2),
        SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9),
        SamplingParams(max_new_tokens=8, ignore_eos=True, frequency_penalty=1.0),
    ]

    async def run(cfg):
        async with Engine(cfg) as engine:
            rs = await asyncio.gather(
                *(engine.complete(p, s) for p, s in zip(PROMPTS[:3], params, strict=True))
            )
        return [
            (r.token_ids, [(e.token_id, round(e.logprob, 4)) for e in r.logprobs or []]) for r in rs
        ]

    one = await run(engine_config(path, runtime={"worker": "inprocess"}))
    two = await run(engine_config(path, parallel={"tp_size": 2}))
    # the same tokens, and logprobs equal to float32's summation noise (tp=2 sums each
    # projection in two halves; a value near a 4th-decimal boundary may round either way)
    assert [tokens for tokens, _ in one] == [tokens for tokens, _ in two]
    for (_, a), (_, b) in zip(one, two, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert all(abs(x - y) <= 2e-4 for (_, x), (_, y) in zip(a, b, strict=True)), (a, b)


async def test_killing_one_rank_fails_closed_and_leaves_no_process(llama):
    path = llama
    engine = Engine(engine_config(path, parallel={"tp_size": 2}))
    stream = engine.core.stream
    assert isinstance(stream, ProcessStream)
    rank1 = stream.processes[1]
    async with engine:
        long = SamplingParams(max_new_tokens=100_000, ignore_eos=True)
        task = asyncio.ensure_future(engine.complete(PROMPTS[0], long))
        await asyncio.sleep(1.0)
        os.kill(rank1.pid, signal.SIGKILL)
        # liveness: the dead rank fails the request within this bound (wait_for raises past it)
        result = await asyncio.wait_for(task, timeout=10)
        assert result.finish_reason == "error"
        assert not engine.healthy
    # rank 0 was stuck in a collective with the dead rank: shutdown terminated it
    assert all(not p.is_alive() for p in stream.processes)


async def test_tp2_prefix_cache_and_per_rank_metrics(llama):
    """Shared prompts hit the host's prefix cache at tp_size=2 (each rank keeps its head shard
    of the cached pages); the scrape shows every rank's step and collective figures."""
    from prometheus_client.parser import text_string_to_metric_families

    from stallfree.metrics.engine_metrics import EngineMetrics

    path = llama
    shared = [5, 6, 7, 8] * 6
    prompts = [[*shared, 9 + i] for i in range(3)]
    want = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    engine = Engine(engine_config(path, parallel={"tp_size": 2}))
    metrics = EngineMetrics("m", "0", engine.snapshot)
    async with engine:
        first = await engine.complete(prompts[0], _params())
        rest = await asyncio.gather(*(engine.complete(p, _params()) for p in prompts[1:]))
        counters = (await _settled_snapshot(engine)).counters
        text = metrics.render().decode()
    assert [r.token_ids for r in [first, *rest]] == want
    assert counters.prefix_cache_hits > 0
    samples = {
        (s.name, s.labels.get("rank")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for rank in ("0", "1"):
        assert samples[("stallfree:worker_steps_total", rank)] == counters.steps
        assert samples[("stallfree:tp_collective_seconds_total", rank)] > 0
        assert samples[("stallfree:tp_collective_bytes_total", rank)] > 0
    assert samples[("stallfree:worker_message_bytes_total", None)] > 0
