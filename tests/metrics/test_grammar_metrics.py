"""The grammar's stream time and tokens on /metrics: at 0 without structured outputs, growing
with a JSON-schema constrained request, equal to the engine's counters, documented."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema

import stallfree
from stallfree import Engine, SamplingParams
from stallfree.metrics import EngineMetrics
from stallfree.runtime.telemetry.stats import EngineCounters
from tests.engine_util import engine_config
from tests.metrics_util import fake_snapshot, samples

SECONDS = "stallfree:grammar_seconds_total"
TOKENS = "stallfree:grammar_tokens_total"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _grammar(engine: Engine) -> tuple[float, float]:
    assert engine.metrics is not None
    scrape = samples(engine.metrics.render())
    # present from the first scrape, constrained request or not
    assert (SECONDS, frozenset()) in scrape and (TOKENS, frozenset()) in scrape
    return scrape[(SECONDS, frozenset())], scrape[(TOKENS, frozenset())]


def test_the_families_read_the_snapshot_counters():
    counters = EngineCounters(grammar_seconds=0.25, grammar_tokens=12)
    metrics = EngineMetrics("m", "0", lambda: fake_snapshot(counters=counters))
    text = metrics.render().decode()
    assert f"# TYPE {SECONDS} counter" in text
    assert f"# TYPE {TOKENS} counter" in text
    scrape = samples(text)
    assert scrape[(SECONDS, frozenset())] == 0.25
    assert scrape[(TOKENS, frozenset())] == 12


async def test_a_constrained_request_moves_the_grammar_families(llama):
    async with Engine(engine_config(llama, runtime={"overlap": True})) as engine:
        assert _grammar(engine) == (0.0, 0.0)
        params = [
            SamplingParams(
                max_new_tokens=60, temperature=1.0, seed=s, structured_outputs={"json": SCHEMA}
            )
            for s in range(4)
        ]
        results = await asyncio.gather(*(engine.complete("Person:", p) for p in params))
        await engine.wait_idle()
        seconds, tokens = _grammar(engine)
        counters = engine.snapshot().counters
    for r in results:
        assert r.error is None, r.error
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert seconds > 0 and tokens > 0
    assert (seconds, tokens) == (counters.grammar_seconds, counters.grammar_tokens)
    # each kept output token advanced its grammar (the last one, EOS, may not)
    assert tokens >= sum(len(r.token_ids) for r in results) - len(results)


async def test_an_unconstrained_run_leaves_them_at_zero(llama):
    async with Engine(engine_config(llama)) as engine:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        results = await asyncio.gather(*(engine.complete("free text", params) for _ in range(3)))
        await engine.wait_idle()
        assert all(len(r.token_ids) == 8 for r in results)
        assert _grammar(engine) == (0.0, 0.0)


def test_the_grammar_families_have_doc_rows():
    serving = (Path(stallfree.__file__).parents[1] / "docs" / "serving.md").read_text()
    for family in ("grammar_seconds_total", "grammar_tokens_total"):
        assert f"`{family}`" in serving, family
