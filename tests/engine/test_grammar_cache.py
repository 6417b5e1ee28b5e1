"""The compiled-grammar cache is capped by estimated bytes, not by count (issue 42, finding 7):
many distinct large schemas keep it under its cap, least recently used out first, and a request
whose grammar was evicted while it ran still finishes on its own copy."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import string

from stallfree import Engine, SamplingParams
from stallfree.runtime.request.structured import StructuredOutputs
from stallfree.runtime.text.grammar_cache import GrammarCache, estimated_bytes
from stallfree.runtime.text.grammar_compiler import MatcherFactory, grammar_text
from stallfree.runtime.text.tokenizer import ByteTokenizer
from tests.engine_util import engine_config

DESCRIPTION = 20_000  # characters each schema carries into its grammar text


def _schema(i: int, value: str) -> dict[str, str]:
    return {"const": value, "description": "d" * DESCRIPTION + str(i)}


def _params(schema: dict[str, str], max_new_tokens: int = 80) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=1.0, seed=1, structured_outputs={"json": schema}
    )


def test_the_cache_keeps_its_bytes_under_the_cap_least_recent_out_first():
    one = estimated_bytes("k0", "x" * 1000)
    cache: GrammarCache[int] = GrammarCache(max_bytes=3 * one)
    for i in range(10):
        cache.put(f"k{i}", i, "x" * 1000)
        assert cache.bytes <= 3 * one
    assert len(cache) == 3 and cache.bytes == 3 * one and cache.evictions == 7
    assert cache.get("k7") == 7  # now the most recent: k8 goes next
    cache.put("ka", 10, "x" * 1000)
    assert "k8" not in cache and "k7" in cache and "k9" in cache
    cache.put("big", -1, "x" * 4000)  # over the whole cap: not kept, nothing else dropped
    assert "big" not in cache and len(cache) == 3
    empty: GrammarCache[int] = GrammarCache(max_bytes=0)
    empty.put("k", 1, "")
    assert len(empty) == 0 and empty.bytes == 0


def test_a_worker_matcher_outlives_its_evicted_template():
    factory = MatcherFactory(ByteTokenizer, 260, cache_bytes=estimated_bytes("", "x" * 30_000))
    texts = [grammar_text(StructuredOutputs(json=_schema(i, f"v{i}"))) for i in range(4)]
    first = factory(texts[0])
    for text in texts[1:]:
        factory(text)
    assert texts[0] not in factory.cache and len(factory.cache) == 1
    gc.collect()
    for byte in json.dumps("v0").encode():
        assert first.consume_token(byte), first.get_error()
    assert first.is_accepting()


async def test_distinct_large_schemas_stay_under_the_cap_and_evicted_ones_still_finish(llama):
    rng = random.Random(0)
    values = ["".join(rng.choices(string.ascii_letters, k=40)) for _ in range(12)]
    schemas = [_schema(i, v) for i, v in enumerate(values)]
    size = estimated_bytes("", grammar_text(StructuredOutputs(json=schemas[0])))
    cap = 3 * size + size // 2  # room for three of them
    cfg = engine_config(
        llama,
        runtime={"grammar_cache_bytes": cap},
        # a reader four tokens behind pauses the stream, so the first request is still running
        # while the others' grammars push its own out of the cache
        scheduler={"max_unread_tokens": 4},
    )
    async with Engine(cfg) as engine:
        cache = engine.core.grammars.cache  # type: ignore[union-attr]
        stream = engine.generate("A value:", _params(schemas[0]))
        texts = [(await anext(stream)).text]
        results = await asyncio.gather(
            *(engine.complete("A value:", _params(s)) for s in schemas[1:])
        )
        assert len(cache) <= 3 and 0 < cache.bytes <= cap and cache.evictions >= 8
        assert not any(values[0] in key for key in cache.keys())  # noqa: SIM118
        gc.collect()
        async for chunk in stream:
            texts.append(chunk.text)
            last = chunk
        assert last.finish_reason == "stop" and last.error is None
        assert "".join(texts) == json.dumps(values[0])
        for r, v in zip(results, values[1:], strict=True):
            assert r.error is None and r.finish_reason == "stop" and r.text == json.dumps(v)
        compiled = engine.core.grammars.compiled  # type: ignore[union-attr]
        again = await engine.complete("A value:", _params(schemas[0]))
        assert again.text == json.dumps(values[0])
        assert engine.core.grammars.compiled == compiled + 1  # type: ignore[union-attr]
        assert cache.bytes <= cap
