"""Structured outputs in the engine: seeded sampled replies validate against their schema in
every overlap x mirrors mode, regex and choice hold, the read guard sees no schedule-path read
under overlap, compile errors name the field, and the grammar composes with n, logprobs,
penalties, min_tokens, the prefix cache and retraction."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from stallfree import Engine, InvalidRequestError, SamplingParams
from stallfree.runtime.execution.grammar_masks import GrammarPlan, GrammarState
from stallfree.runtime.request.req import Req
from tests.engine_util import engine_config, guarded

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
MODES = [
    pytest.param(True, True, id="overlap-mirrors"),
    pytest.param(True, False, id="overlap-legacy"),
    pytest.param(False, True, id="plain-mirrors"),
    pytest.param(False, False, id="plain-legacy"),
]


def _json(seed: int, **extra: object) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=120,
        temperature=1.0,
        seed=seed,
        structured_outputs={"json": SCHEMA},
        **extra,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_fifty_seeded_sampled_replies_validate_in_every_mode(llama, overlap, mirrors):
    cfg = engine_config(llama, runtime={"overlap": overlap, "cpu_mirrors": mirrors})
    async with Engine(cfg) as engine:
        results = await asyncio.gather(
            *(engine.complete("Tell me about a person:", _json(seed)) for seed in range(50))
        )
        for r in results:
            assert r.error is None and r.finish_reason == "stop", (r.error, r.text)
            jsonschema.validate(json.loads(r.text), SCHEMA)
        assert len({r.text for r in results}) > 10  # sampled, not one forced answer
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_structured_batch_under_overlap_reads_nothing_on_the_schedule_path(llama):
    cfg = engine_config(llama, runtime={"overlap": True, "strict": True})
    async with guarded(Engine(cfg)) as engine:
        results = await asyncio.gather(
            *(engine.complete("Person:", _json(seed)) for seed in range(8)),
            engine.complete("free text", SamplingParams(max_new_tokens=8, ignore_eos=True)),
        )
        for r in results[:8]:
            jsonschema.validate(json.loads(r.text), SCHEMA)
        monitor = engine.core.monitor
        assert monitor.guard is not None and monitor.guard.violations == 0
        assert monitor.schedule_path_reads == 0 and monitor.total_stalls() == 0
        stats = engine.core.scheduler.stats
        assert stats.overlap_steps > 0
        assert stats.grammar_tokens >= sum(len(r.token_ids) for r in results[:8]) - 8
        assert stats.grammar_seconds > 0


async def _sampled(engine: Engine, prompt: str, spec: dict, n: int = 10) -> list:
    """`n` seeded temperature-1.0 replies constrained by `spec`."""
    return await asyncio.gather(
        *(
            engine.complete(
                prompt,
                SamplingParams(max_new_tokens=20, temperature=1.0, seed=s, structured_outputs=spec),
            )
            for s in range(n)
        )
    )


async def test_a_reply_writes_the_properties_in_the_schemas_order(llama):
    # a schema given as an object keeps its order (it once compiled with sorted keys)
    schema = {
        "type": "object",
        "properties": {
            "zeta": {"type": "integer", "minimum": 0, "maximum": 9},
            "alpha": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    async with Engine(engine_config(llama)) as engine:
        for spec in ({"json": schema}, {"json": json.dumps(schema)}):
            for r in await _sampled(engine, "numbers:", spec, n=4):
                assert list(json.loads(r.text)) == ["zeta", "alpha"], r.text


async def test_regex_and_choice_hold_for_sampled_replies(llama):
    async with Engine(engine_config(llama)) as engine:
        regex = r"[a-c]{2,4}-[0-9]{3}"
        for r in await _sampled(engine, "code:", {"regex": regex}):
            assert re.fullmatch(regex, r.text) and r.finish_reason == "stop", r.text
        choices = ["yes", "no", "maybe later"]
        picked = await _sampled(engine, "answer:", {"choice": choices})
        assert all(r.text in choices for r in picked)
        assert len({r.text for r in picked}) > 1
        lark = await engine.complete(
            "x",
            SamplingParams(
                max_new_tokens=20,
                temperature=1.0,
                structured_outputs={"grammar": 'start: "x" ("y" | "z")+ "!"'},
            ),
        )
        assert re.fullmatch(r"x[yz]+!", lark.text)
        gbnf = await engine.complete(
            "x", SamplingParams(max_new_tokens=20, structured_outputs={"grammar": 'root ::= "hi"'})
        )
        assert gbnf.text == "hi"


async def test_compile_errors_name_the_field_and_the_engine_goes_on(llama):
    async with Engine(engine_config(llama)) as engine:
        with pytest.raises(InvalidRequestError, match="regex cannot be compiled") as err:
            await engine.complete("x", SamplingParams(structured_outputs={"regex": "a(b"}))
        assert err.value.param == "structured_outputs"
        bad = {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
        with pytest.raises(InvalidRequestError, match="JSON schema cannot be compiled"):
            await engine.complete("x", SamplingParams(structured_outputs=bad))
        with pytest.raises(InvalidRequestError, match="not valid JSON"):
            await engine.complete("x", SamplingParams(structured_outputs={"json": "{not json"}))
        deep = '{"not":' * 8000 + "{}" + "}" * 8000
        for spec in ({"json": deep}, {"grammar": "start: %json " + deep}):
            with pytest.raises(InvalidRequestError, match="nests too deeply"):
                await engine.complete("x", SamplingParams(structured_outputs=spec))
        ok = await engine.complete("x", SamplingParams(structured_outputs={"choice": ["a"]}))
        assert ok.text == "a"
        await engine.wait_idle()
        assert engine.pool_usage().all_free and not engine.requests


async def test_repeated_schemas_compile_once(llama):
    async with Engine(engine_config(llama)) as engine:
        await asyncio.gather(*(engine.complete("p", _json(s)) for s in range(4)))
        grammars = engine.core.grammars
        assert grammars is not None and grammars.compiled == 1 and grammars.hits >= 1


async def test_composes_with_logprobs_penalties_min_tokens_and_stop(llama):
    async with Engine(engine_config(llama)) as engine:
        r = await engine.complete(
            "p",
            _json(3, logprobs=2, presence_penalty=0.5, repetition_penalty=1.3, stop=["zzz"]),
        )
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
        # the grammar completes before min_tokens allows EOS: the grammar wins, nothing is NaN
        short = await engine.complete(
            "p",
            SamplingParams(
                max_new_tokens=30,
                temperature=1.0,
                min_tokens=10,
                structured_outputs={"choice": ["ok"]},
            ),
        )
        assert short.text == "ok" and short.error is None
        # ignore_eos: a complete grammar still ends the request
        done = await engine.complete(
            "p",
            SamplingParams(max_new_tokens=30, ignore_eos=True, structured_outputs={"regex": "ab"}),
        )
        assert done.text == "ab" and done.finish_reason == "stop"
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_retraction_and_the_prefix_cache_restart_the_grammar_where_the_host_is(llama):
    """A pool too small for every request: some are retracted and re-prefilled, and their
    matchers restart at the outputs the host knows; replies stay valid."""
    cfg = engine_config(
        llama,
        cache={"page_size": 4, "max_total_tokens": 320, "max_running_requests": 8},
        scheduler={"new_token_ratio": 0.05},
    )
    async with Engine(cfg) as engine:
        results = await asyncio.gather(
            *(engine.complete("Same prefix for all, person:", _json(seed)) for seed in range(12))
        )
        for r in results:
            assert r.error is None, r.error
            jsonschema.validate(json.loads(r.text), SCHEMA)
        assert engine.core.scheduler.stats.retractions > 0
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_unsupported_layouts_and_paths_are_clear_errors():
    from stallfree.runtime.text.grammar_compiler import unsupported_reason

    assert unsupported_reason("cpu", in_process=True) is None
    assert unsupported_reason("cuda", in_process=False) is None  # worker processes
    assert "--worker process" in (unsupported_reason("cuda", in_process=True) or "")
    req = Req("r", [1, 2], SamplingParams(structured_outputs={"choice": ["a"]}))
    with pytest.raises(InvalidRequestError, match="disaggregated or imported-KV"):
        req.check_grammar()


def test_a_dead_end_is_reported_to_the_host_and_masks_only_eos(llama):
    """A token the grammar refuses (what a dead end looks like): the matcher errors, the plan
    says so for the host, and the next mask allows EOS alone."""
    from llguidance import LLMatcher

    from stallfree.runtime.model.loader import load_tokenizer
    from stallfree.runtime.text.grammar_compiler import RequestGrammar, build_lltokenizer

    tok = load_tokenizer(llama)
    vocab = tok.vocab_size
    lltok = build_lltokenizer(tok, vocab)
    matcher = LLMatcher(lltok, LLMatcher.grammar_from_regex("ab"), log_level=0)
    state = GrammarState(num_slots=4, vocab=vocab)
    plan = GrammarPlan(
        [0], [2], [True], [(2, RequestGrammar("", matcher), [])], torch.tensor([0]), [(2, 0, 1)]
    )
    state.start(plan)
    logits = torch.zeros(1, vocab)
    started = plan.seconds
    masked = state.apply(logits, plan, logits)
    assert plan.seconds > started  # applying the mask is grammar time too
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [ord("a")]
    state.advance(plan, torch.tensor([ord("z")]))
    how, message, taken = plan.ended[0]
    assert taken == 1
    assert how == "error" and "doesn't satisfy the grammar" in message
    after = state.apply(logits, plan, logits)
    assert torch.isfinite(after[0]).nonzero().flatten().tolist() == sorted(tok.eos_token_ids)


LOOSE = {  # pydantic's and LangChain's shape: no additionalProperties
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
async def test_strict_by_default_a_schema_allows_only_the_keys_it_names(llama, strict):
    cfg = engine_config(llama, runtime={"structured_outputs_strict": strict})
    async with Engine(cfg) as engine:
        replies = await _sampled(engine, "a:", {"json": LOOSE}, n=12)
        keys = [list(json.loads(r.text)) if r.finish_reason == "stop" else None for r in replies]
        if strict:
            assert keys == [["a"]] * 12, [r.text for r in replies]
        else:  # JSON schema's own default: the model may add keys (and run to max_tokens)
            assert any(k != ["a"] for k in keys), [r.text for r in replies]


async def test_regex_classes_are_ascii(llama):
    async with Engine(engine_config(llama)) as engine:
        replies = await _sampled(engine, "n:", {"regex": r"\d{3}\s\w"}, n=12)
        for r in replies:
            assert re.fullmatch(r"[0-9]{3}[ \t\n\r\f\v][0-9A-Za-z_]", r.text), r.text
        pattern = {"type": "string", "pattern": r"^\d\d$"}
        schema = {"type": "object", "properties": {"d": pattern}, "required": ["d"]}
        for r in await _sampled(engine, "d:", {"json": schema}, n=6):
            assert re.fullmatch(r'\{"d":\s*"[0-9]{2}"\}', r.text), r.text
