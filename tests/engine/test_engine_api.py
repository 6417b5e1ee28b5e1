"""The embedding API: streaming, bad input, cancellation, stop conditions, disaggregated KV."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from stallfree import Engine, InvalidRequestError, SamplingParams
from stallfree.runtime.model.loader import ModelLoadError
from tests.engine_util import engine_config, random_prompts
from tests.hf_models import hf_greedy


async def test_streaming_chunks_add_up(llama):
    async with Engine(engine_config(llama, runtime={"strict": True})) as engine:
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        chunks = [c async for c in engine.generate("Hello, world", params)]
        full = await engine.complete("Hello, world", params)
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].prompt_tokens == len(b"Hello, world")
    assert chunks[-1].completion_tokens == 12
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert full.token_ids == hf_greedy(llama, list(b"Hello, world"), 12)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ("", None, InvalidRequestError, "prompt is empty"),
        ([], None, InvalidRequestError, "prompt is empty"),
        ([1] * 2000, None, InvalidRequestError, "maximum context length is 1024"),
        ([1, 999], None, InvalidRequestError, "out of range"),
        ("hi", {"temperature": -1}, ValidationError, "temperature"),
        ("hi", {"top_p": 1.5}, ValidationError, "top_p"),
        ("hi", {"top_p": 0}, ValidationError, "top_p"),
        ("hi", {"max_new_tokens": 0}, ValidationError, "max_new_tokens"),
        ("hi", {"top_k": 0}, ValidationError, "top_k"),
        ("hi", {"bogus": 1}, ValidationError, "bogus"),
    ],
)
async def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(
    llama, prompt, params, error, match
):
    async with Engine(engine_config(llama)) as engine:
        with pytest.raises(error, match=match):
            await engine.complete(prompt, params)
        ok = await engine.complete("still serving", {"max_new_tokens": 4, "ignore_eos": True})
        assert len(ok.token_ids) == 4
        await engine.wait_idle()
        assert engine.pool_usage().all_free


def test_unknown_model_path_is_a_clear_error(tmp_path):
    # the engine is whole when constructed: a bad model fails there, not at start()
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(engine_config(str(tmp_path / "nope")))


@pytest.mark.parametrize("overlap", [True, False])
async def test_cancelling_the_consumer_aborts_and_frees(llama, overlap):
    async with Engine(engine_config(llama, runtime={"overlap": overlap})) as engine:
        got: list[int] = []

        async def consume() -> None:
            async for chunk in engine.generate(
                "a long one", {"max_new_tokens": 500, "ignore_eos": True}
            ):
                got.extend(chunk.token_ids)

        task = asyncio.create_task(consume())
        while len(got) < 5:
            await asyncio.sleep(0.001)
        assert engine.pool_usage().kv_tokens_free < engine.pool_usage().kv_tokens_total
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        assert len(got) < 500
        # and it still serves
        assert (
            len(
                (await engine.complete("next", {"max_new_tokens": 3, "ignore_eos": True})).token_ids
            )
            == 3
        )


async def test_stop_token_and_stop_string(llama):
    prompt = list(b"stop test")
    ref = hf_greedy(llama, prompt, 20)
    async with Engine(engine_config(llama)) as engine:
        # stop token: the first occurrence of ref[5] ends the output, inclusive
        stop_tok = ref[5]
        out = await engine.complete(
            prompt, {"max_new_tokens": 20, "stop_token_ids": [stop_tok], "ignore_eos": True}
        )
        first = ref.index(stop_tok)
        assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
        # stop string: text before it is returned, the stop string itself is not
        full = await engine.complete(prompt, {"max_new_tokens": 20, "ignore_eos": True})
        text = full.text
        printable = [i for i in range(2, len(text) - 1) if text[i : i + 2].isprintable()]
        if printable:
            i = printable[0]
            stop = text[i : i + 2]
            cut = await engine.complete(
                prompt, {"max_new_tokens": 20, "stop": [stop], "ignore_eos": True}
            )
            assert cut.finish_reason == "stop"
            assert cut.text == text[: text.index(stop)]
            assert stop not in cut.text


async def test_eos_stops_unless_ignored(llama):
    prompt = list(b"eos?")
    ref = hf_greedy(llama, prompt, 16)
    async with Engine(engine_config(llama)) as engine:
        eos = ref[3]
        engine.tokenizer.eos_token_ids.append(eos)  # make a token the model emits count as EOS
        engine_eos = frozenset(engine.tokenizer.eos_token_ids)
        out = await engine.complete(prompt, {"max_new_tokens": 16})
        assert out.token_ids == ref[: ref.index(eos) + 1] and out.finish_reason == "stop"
        out = await engine.complete(prompt, {"max_new_tokens": 16, "ignore_eos": True})
        assert out.token_ids == ref and eos in engine_eos


async def test_seeded_sampling_is_reproducible_across_batches(llama):
    params = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    async with Engine(engine_config(llama)) as engine:
        alone = await engine.complete("sample me", params)
        crowd = await asyncio.gather(
            engine.complete("sample me", params),
            *(
                engine.complete(p, {"max_new_tokens": 16, "temperature": 1.0})
                for p in random_prompts(5)
            ),
        )
    assert crowd[0].token_ids == alone.token_ids


async def test_kv_import_continues_like_transformers(llama):
    """Decode-side disaggregation: prompt KV computed elsewhere (here: by transformers)."""
    from transformers import AutoModelForCausalLM

    prompt = list(b"disaggregated prefill")
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    first = int(out.logits[0, -1].argmax())
    cache = out.past_key_values
    kv = []
    for layer in range(hf.config.num_hidden_layers):
        k, v = cache.layers[layer].keys, cache.layers[layer].values  # [1, KVH, T, D]
        kv.append((k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()))
    ref = hf_greedy(llama, prompt, 10)
    async with Engine(engine_config(llama, cache={"page_size": 4})) as engine:
        ids: list[int] = []
        async for chunk in engine.generate_imported(
            prompt, kv, first, {"max_new_tokens": 10, "ignore_eos": True}
        ):
            ids.extend(chunk.token_ids)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        with pytest.raises(InvalidRequestError, match="imported KV"):
            async for _ in engine.generate_imported(prompt, kv[:1], first):
                pass
    assert ids == ref


async def test_shutdown_drains_in_flight_requests(llama):
    engine = Engine(engine_config(llama))
    await engine.start()
    tasks = [
        asyncio.create_task(engine.complete(p, {"max_new_tokens": 8, "ignore_eos": True}))
        for p in random_prompts(4)
    ]
    await asyncio.sleep(0)
    await engine.shutdown(drain=True)
    results = await asyncio.gather(*tasks)
    assert all(len(r.token_ids) == 8 for r in results)
    with pytest.raises(Exception, match="not running"):
        await engine.complete("late", None)


async def test_engine_from_section_overrides_and_not_both(llama):
    async with Engine(model={"path": llama}, runtime={"device": "cpu", "overlap": False}) as engine:
        assert engine.config.runtime.overlap is False
        assert len((await engine.complete("x", {"max_new_tokens": 2})).token_ids) == 2
    with pytest.raises(TypeError, match="not both"):
        Engine(engine_config(llama), runtime={"overlap": False})


async def test_streaming_state_stays_bounded_over_long_outputs(llama):
    """Only text not yet streamed is kept per request, so per-token work does not grow."""
    from stallfree.runtime.telemetry.observer import EngineObserver

    engine = Engine(engine_config(llama))

    class Watch(EngineObserver):
        def __init__(self) -> None:
            self.longest = 0

        def on_tokens(self, req, count, now) -> None:
            self.longest = max(self.longest, engine.core.output.held_text_len(req))

    watch = Watch()
    engine.add_observer(watch)
    async with engine:
        params = {"max_new_tokens": 300, "ignore_eos": True, "stop": ["\x00never\x00"]}
        out = await engine.complete("a long stream", params)
        plain = await engine.complete("a long stream", {"max_new_tokens": 300, "ignore_eos": True})
    assert out.completion_tokens == 300 and out.text == plain.text
    assert len(out.text) > 64
    assert watch.longest < 16  # the longest stop string, plus one token's text


async def test_closing_generate_early_aborts_the_request_at_once(llama):
    """A consumer that stops and closes the stream frees the request during `aclose()`, not
    when the garbage collector later finalises the inner generators."""
    async with Engine(engine_config(llama)) as engine:
        stream = engine.generate([1, 2, 3], {"max_new_tokens": 500, "ignore_eos": True}, rid="r")
        first = await anext(stream)
        assert first.token_ids and "r" in engine.requests
        await stream.aclose()
        assert "r" not in engine.requests  # unregistered and aborted inside aclose()
        await engine.wait_idle()
        assert engine.pool_usage().all_free


def test_generate_prebuilt_still_names_the_kv_import() -> None:
    """Applications written against the earlier name keep working."""
    assert Engine.generate_prebuilt is Engine.generate_imported
