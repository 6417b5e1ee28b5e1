"""Structured outputs with speculative decoding: each draft position is masked at the state
the grammar reaches after the drafts before it, rejected drafts roll the matcher back, and the
replies equal the same requests without speculation (float64, greedy), conform to their
schema, and leave the strict read guard silent."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from stallfree import Engine, SamplingParams
from stallfree.entrypoints.server.chat.tool_parsers import PARSERS
from stallfree.runtime.execution.grammar_masks import GrammarPlan, GrammarState
from stallfree.runtime.text.grammar_compiler import RequestGrammar, build_lltokenizer
from stallfree.runtime.text.tokenizer import ByteTokenizer
from tests.engine_util import engine_config, guarded

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-c]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
    "required": ["city"],
    "additionalProperties": False,
}
CALL = PARSERS["hermes"]().forced_grammar([("get_weather", WEATHER)], many=False)
# prompts that hold the answer's shape: prompt lookup drafts from them
PROMPTS = [
    '{"name": "abcabc", "age": 12, "ok": true} {"name": "abcabc", "age": 12, "ok": true} {"name": "',
    '{"name":"aaaa","age":7,"ok":false}{"name":"aaaa","age":7,"ok":false}',
    "Tell me about a person:",
]


def _requests() -> list[tuple[str, SamplingParams]]:
    out = [
        (p, SamplingParams(max_new_tokens=120, structured_outputs={"json": SCHEMA}))
        for p in PROMPTS
    ]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
    forced = SamplingParams(max_new_tokens=160, structured_outputs={"grammar": CALL})
    out.append((call * 2, forced))
    out.append(("free text free text free text", SamplingParams(max_new_tokens=12)))
    return out


async def _run(cfg):
    engine = guarded(Engine(cfg))
    async with engine:
        results = await asyncio.gather(*(engine.complete(p, s) for p, s in _requests()))
        sampled = await asyncio.gather(
            *(
                engine.complete(
                    PROMPTS[0],
                    SamplingParams(
                        max_new_tokens=120,
                        temperature=1.0,
                        seed=seed,
                        structured_outputs={"json": SCHEMA},
                    ),
                )
                for seed in range(6)
            )
        )
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    return results, sampled, engine


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overlap", "method"),
    [(True, "ngram"), (False, "ngram"), (True, "draft_model")],
    ids=["overlap-ngram", "plain-ngram", "overlap-draft-model"],
)
async def test_speculation_with_grammars_equals_no_speculation(llama, overlap, method):
    runtime = {"overlap": overlap, "strict": True}
    model = {"dtype": "float64"}
    want, _, _ = await _run(engine_config(llama, model=model, runtime=runtime))
    spec = {"method": method, "num_speculative_tokens": 3, "cost_aware": False}
    if method == "draft_model":
        spec["draft_model"] = llama  # the model drafts for itself: most drafts are accepted
    got, sampled, engine = await _run(
        engine_config(llama, model=model, runtime=runtime, speculative=spec)
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for r in [*got[:3], *sampled]:
        assert r.error is None and r.finish_reason == "stop", (r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert set(json.loads(r.text)) == {"name", "age", "ok"}
    call = got[3].text
    assert got[3].finish_reason == "stop", call
    body = json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert body["name"] == "get_weather"
    jsonschema.validate(body["arguments"], WEATHER)
    stats = engine.core.scheduler.stats
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    monitor = engine.core.monitor
    assert monitor.guard is not None and monitor.guard.violations == 0
    assert monitor.schedule_path_reads == 0


def test_draft_positions_are_masked_at_the_state_their_drafts_reach():
    """One request scoring 4 positions (its last token and drafts "a", "b", "z") for the
    regex `ab[0-9]`: position 1 allows "b" only, position 2 a digit, position 3 (after a
    refused draft) is unmasked; the matcher is back where it was, then keeps "a", "b" and
    the step's own token."""
    vocab = 300
    lltok = build_lltokenizer(ByteTokenizer(), vocab)
    matcher = LLMatcher(lltok, LLMatcher.grammar_from_regex("ab[0-9]"), log_level=0)
    state = GrammarState(num_slots=2, vocab=vocab)
    rows = [0, 1, 2, 3]
    plan = GrammarPlan(
        rows, [1] * 4, [True] * 4, [(1, RequestGrammar("", matcher), [])], torch.tensor(rows),
        [(1, 0, 4)],
    )  # fmt: skip
    plan.inputs = torch.tensor([9, ord("a"), ord("b"), ord("z")])
    state.start(plan)
    logits = torch.zeros(4, vocab)
    masked = state.apply(logits, plan, logits)
    allowed = [torch.isfinite(masked[j]).nonzero().flatten().tolist() for j in range(4)]
    assert allowed[0] == [ord("a")]
    assert allowed[1] == [ord("b")]
    assert allowed[2] == list(range(ord("0"), ord("9") + 1))
    assert len(allowed[3]) == vocab  # "z" is refused at position 2: never accepted
    assert matcher.try_consume_tokens([ord("a")]) == 1  # rolled back to the start
    matcher.rollback(1)
    # acceptance: drafts "a" and "b" kept, then the step's own "7" at position 2
    state.advance(plan, torch.tensor([ord("a"), ord("b"), ord("7"), 0]))
    assert plan.tokens == 3 and plan.ended == {0: ("complete", "", 3)}
