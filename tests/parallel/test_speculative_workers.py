"""Speculative decoding with the model in worker processes (`worker=process`, and `tp_size=2`
on gloo): each rank builds the proposer (n-gram lookup, or a draft model whole on every rank)
and runs the verify step as the in-process engine does, the host replica of the device
lengths follows each verify step's answer, and greedy output equals the in-process engine
without speculation, under chunked prefill, retraction and the prefix cache; structured
outputs with speculation through a worker process conform and equal them too."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from stallfree import Engine, SamplingParams
from tests.engine.test_speculative import (
    NGRAM,
    REPEAT,
    bigram_llama,  # noqa: F401 (a fixture)
    cycling_prompt,
    generate,
    method_spec,
    run_all,
    spec_config,
    stressed,
)
from tests.engine.test_structured_spec import PROMPTS, SCHEMA, WEATHER
from tests.engine.test_structured_spec import _run as run_structured
from tests.engine_util import engine_config, random_prompts

pytestmark = pytest.mark.slow  # worker processes start in seconds


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    return [*random_prompts(5, seed=3, lo=5, hi=40), REPEAT]  # as tests/engine/test_speculative


def _layout(name: str, sections: dict[str, Any]) -> dict[str, Any]:
    if name == "tp2-gloo":
        sections["parallel"] = {"tp_size": 2}
    else:
        sections["runtime"]["worker"] = "process"
    return sections


def _spec_counts(snap: Any) -> tuple[int, int, int]:
    assert snap.spec is not None
    return (snap.spec.num_drafts, snap.spec.num_draft_tokens, snap.spec.num_accepted_tokens)


CASES = [
    pytest.param("worker-process", "ngram", True, True, id="worker-ngram-overlap-mirrors"),
    pytest.param("worker-process", "ngram", True, False, id="worker-ngram-overlap-legacy"),
    pytest.param("worker-process", "ngram", False, True, id="worker-ngram-plain-mirrors"),
    pytest.param("tp2-gloo", "ngram", True, True, id="tp2-ngram-overlap-mirrors"),
    pytest.param("worker-process", "draft_model", True, True, id="worker-draft-overlap-mirrors"),
]


@pytest.mark.parametrize(("layout", "method", "overlap", "mirrors"), CASES)
async def test_greedy_output_through_workers_equals_in_process(
    llama, workload, layout, method, overlap, mirrors
):
    """Chunked prefill, a pool small enough to retract mid-window, the prefix cache and the
    mirror checks; the same output as no speculation, and the same drafts offered and
    accepted as the in-process engine in the same mode."""
    ref, _ = await generate(spec_config(llama, None, **stressed(4)), workload, 40)
    spec = method_spec(method, llama, 3)
    mode = stressed(4)  # planned as the workers' engine plans (legacy: one step at a time)
    mode["runtime"].update(overlap=overlap and mirrors, cpu_mirrors=mirrors)
    _, in_process = await generate(spec_config(llama, spec, **mode), workload, 40)
    mode = stressed(4)
    mode["runtime"].update(overlap=overlap, cpu_mirrors=mirrors)
    cfg = spec_config(llama, spec, **_layout(layout, mode))
    async with Engine(cfg) as engine:
        # legacy reads come from the host replica: each step is planned after the one before
        assert engine.core.loop.overlap is (overlap and mirrors)
        out = await run_all(engine, workload, 40)
        await engine.wait_idle()
        snap = engine.snapshot()
        overlapped = engine.core.loop.stats.overlap_steps
    assert out == ref
    assert snap.pools.all_free
    assert snap.counters.retractions > 0  # the small pool retracted mid-window
    assert (overlapped > 0) is (overlap and mirrors)
    assert _spec_counts(snap) == _spec_counts(in_process)
    assert snap.spec is not None and snap.spec.num_accepted_tokens > 0
    assert snap.spec.num_accepted_tokens < snap.spec.num_draft_tokens or method != "ngram"


async def test_repetitive_text_through_a_worker_accepts_most_drafts_beside_logprobs(
    bigram_llama,  # noqa: F811 (the fixture imported above)
):
    """Most drafts accepted (several tokens a step); a request asking for logprobs (its rows
    carry no drafts) shares the verify steps and gets the in-process engine's logprobs."""
    prompt = await cycling_prompt(bigram_llama)
    plain = SamplingParams(max_new_tokens=40, ignore_eos=True)
    scored = SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=2)

    async def both(cfg: Any) -> tuple[Any, Any, Any]:
        async with Engine(cfg) as engine:
            a, b = await asyncio.gather(
                engine.complete(prompt, plain), engine.complete(prompt[1:], scored)
            )
            await engine.wait_idle()
            assert engine.pool_usage().all_free
            return a, b, engine.snapshot()

    want_a, want_b, _ = await both(spec_config(bigram_llama, None))
    got_a, got_b, snap = await both(spec_config(bigram_llama, NGRAM, runtime={"worker": "process"}))
    assert got_a.error is None and got_b.error is None
    assert (got_a.token_ids, got_b.token_ids) == (want_a.token_ids, want_b.token_ids)
    assert snap.spec is not None and snap.spec.acceptance_rate > 0.8
    assert snap.spec.mean_acceptance_length > 2.0
    assert got_b.logprobs is not None and want_b.logprobs is not None
    assert len(got_b.logprobs) == len(want_b.logprobs) == 40
    for x, y in zip(got_b.logprobs, want_b.logprobs, strict=True):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-9
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


async def test_structured_outputs_with_speculation_through_a_worker_process(llama):
    runtime = {"strict": True}
    model = {"dtype": "float64"}
    want, _, _ = await run_structured(engine_config(llama, model=model, runtime=runtime))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "cost_aware": False}
    worker = {**runtime, "worker": "process"}
    got, sampled, engine = await run_structured(
        engine_config(llama, model=model, runtime=worker, speculative=spec)
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for r in [*got[:3], *sampled]:
        assert r.error is None and r.finish_reason == "stop", (r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)
    body = json.loads(got[3].text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    jsonschema.validate(body["arguments"], WEATHER)
    stats = engine.core.scheduler.stats
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    monitor = engine.core.monitor
    assert monitor.guard is not None and monitor.guard.violations == 0


async def _http_replies(live: Any) -> list[Any]:
    """Over HTTP with the openai client: greedy and seeded JSON-schema replies, and a forced
    tool call (the hermes template)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    user = [{"role": "user", "content": PROMPTS[0]}]
    out: list[Any] = []
    for seed in (None, 0, 1, 2):
        r = await live.client.chat.completions.create(
            model="test-model", messages=user, max_tokens=120, seed=seed,
            temperature=0 if seed is None else 1.0, response_format=fmt,
        )  # fmt: skip
        out.append((r.choices[0].finish_reason, r.choices[0].message.content))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    r = await live.client.chat.completions.create(
        model="test-model", messages=user, max_tokens=160, temperature=0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls or []
    out.append((call.function.name, call.function.arguments))
    return out


@contextlib.asynccontextmanager
async def _served(llama: str, **sections: Any) -> AsyncIterator[Any]:
    """`tests.server_util.serving` in float64 (the equality needs it), with the hermes parser
    and chat template."""
    from openai import AsyncOpenAI

    from stallfree.entrypoints.server import create_app, start_server
    from tests.serving.test_structured_strict_http import HERMES_TEMPLATE

    server = {"served_model_name": "test-model", "tool_call_parser": "hermes"}
    model = {"dtype": "float64"}
    engine = Engine(engine_config(llama, model=model, server=server, **sections))
    running = await start_server(create_app(engine))
    client = AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
    try:
        engine.tokenizer.chat_template = HERMES_TEMPLATE
        yield SimpleNamespace(engine=engine, client=client)
    finally:
        await client.close()
        await running.stop()
        await engine.shutdown()


async def test_structured_outputs_over_http_with_speculation_in_a_worker_process(llama):
    """`--worker process --speculative-config '{"method": "ngram"}'`: the replies conform and
    the greedy ones equal an in-process server's without speculation."""
    async with _served(llama, runtime={"strict": True}) as live:
        want = await _http_replies(live)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "cost_aware": False}
    runtime = {"worker": "process", "strict": True}
    async with _served(llama, runtime=runtime, speculative=spec) as live:
        got = await _http_replies(live)
        stats = live.engine.core.scheduler.stats
        assert stats.spec_num_drafts > 0
        assert live.engine.core.monitor.schedule_path_reads == 0
    assert got[0] == want[0] and got[-1] == want[-1]  # greedy: reply and tool call
    for finish, text in got[:4]:
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    jsonschema.validate(json.loads(got[-1][1]), WEATHER)
