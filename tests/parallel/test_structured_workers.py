"""Structured outputs with the model in worker processes (`worker=process`, and `tp_size=2` on
gloo): each rank rebuilds a request's matcher from the grammar's text and masks the logits it
samples from, so replies conform, equal the in-process engine's token for token (greedy and
seeded), a completed grammar ends its request on the host, and the strict read guard stays
silent."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from stallfree import Engine, SamplingParams
from stallfree.entrypoints.server.chat.tool_parsers import PARSERS
from tests.engine_util import engine_config, guarded

pytestmark = pytest.mark.slow  # worker processes start in seconds

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,  # a Lark grammar's %json is the server's to make strict
}
CALL = PARSERS["hermes"]().forced_grammar([("get_weather", WEATHER)], many=False)
LAYOUTS = [
    pytest.param({"runtime": {"worker": "process"}}, id="worker-process"),
    pytest.param({"parallel": {"tp_size": 2}}, id="tp2-gloo"),
]


def _requests() -> list[tuple[str, SamplingParams]]:
    out = []
    for seed in range(4):  # seeded, sampled
        spec = {"json": SCHEMA}
        params = SamplingParams(
            max_new_tokens=80, temperature=1.0, seed=seed, structured_outputs=spec
        )
        out.append((f"Person {seed}:", params))
    greedy = SamplingParams(max_new_tokens=80, structured_outputs={"json": SCHEMA})
    out.append(("Tell me about a person:", greedy))
    forced = SamplingParams(max_new_tokens=160, structured_outputs={"grammar": CALL})
    out.append(("Weather in Paris?", forced))
    out.append(("free text", SamplingParams(max_new_tokens=8, ignore_eos=True)))
    return out


async def _run(cfg) -> tuple[list, Engine]:
    engine = guarded(Engine(cfg))
    async with engine:
        results = await asyncio.gather(*(engine.complete(p, s) for p, s in _requests()))
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    return results, engine


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_structured_outputs_in_worker_processes_equal_in_process(llama, layout):
    strict = {"overlap": True, "strict": True}
    want, _ = await _run(engine_config(llama, runtime={**strict, "worker": "inprocess"}))
    sections = {k: dict(v) for k, v in layout.items()}
    sections["runtime"] = {**strict, **sections.get("runtime", {})}
    got, engine = await _run(engine_config(llama, **sections))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for r in got[:5]:
        assert r.error is None and r.finish_reason == "stop", (r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert set(json.loads(r.text)) == {"name", "age", "ok"}  # strict: no other keys
    call = got[5].text
    assert got[5].finish_reason == "stop", call
    assert call.startswith("<tool_call>\n") and call.endswith("\n</tool_call>"), call
    body = json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert body["name"] == "get_weather"
    jsonschema.validate(body["arguments"], WEATHER)
    monitor = engine.core.monitor
    assert monitor.guard is not None and monitor.guard.violations == 0
    assert monitor.schedule_path_reads == 0
    stats = engine.core.scheduler.stats
    assert stats.grammar_tokens >= sum(len(r.token_ids) for r in got[:6]) - 6
    assert stats.grammar_seconds > 0  # the workers' grammar time reaches the host


def test_a_step_message_reaches_the_workers_device_whole():
    """The logits processors' parts (a dict in the plan) moved to a worker's device too: on
    CUDA the grammar's rows were left on the host and the step failed."""
    from stallfree.runtime.execution.grammar_masks import GrammarPlan
    from stallfree.runtime.execution.logits import LogitsPlan
    from stallfree.runtime.execution.worker import _to_device

    rows = torch.tensor([0, 1])
    part = GrammarPlan([0, 1], [3, 4], [True, True], [], rows, [(3, 0, 1), (4, 1, 1)])
    plan = _to_device(LogitsPlan({"grammar": part}), torch.device("meta"))
    assert plan.grammar is not None and plan.grammar.rows_t.device.type == "meta"
    assert plan.grammar.slots == [3, 4]
