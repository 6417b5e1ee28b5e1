"""vLLM's `bad_words` in the engine: greedy outputs with banned words equal transformers'
`generate(bad_words_ids=...)` exactly in every overlap x mirrors mode (single- and multi-token
words, rows with and without them in one batch), the read guard sees no schedule-path read under
overlap, a retracted request's history is rebuilt where the host is, vLLM's tokenization rule,
and the bounds name the field."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from stallfree import Engine, InvalidRequestError, SamplingParams
from stallfree.runtime.execution.bad_words import HISTORY, BadWordsRows, BadWordsState
from stallfree.runtime.request.req import Req
from stallfree.runtime.request.sampling_params import MAX_BAD_WORD_TOKENS
from tests.engine_util import MODES, engine_config, guarded
from tests.hf_models import EOS_ID, _load_hf

MAX_NEW = 40
# prompts whose greedy reply (tiny llama, seed 0) holds these words: "99" and "HK" are two
# tokens, "}}}" three, "+" one (the byte-level tokenizer has a token per byte)
CASES = [
    ("Hello, my name is", ["99"]),
    ("abc", ["HK", "}}}"]),
    ("Hello, my name is", ["+"]),
]


@functools.cache
def _hf_banned(model_dir: str, prompt: tuple[int, ...], words: tuple[tuple[int, ...], ...]):
    """transformers' greedy reply with `bad_words_ids` (it compares the prompt too; none of
    these prompts ends with a word's prefix, so that is vLLM's rule here)."""
    from transformers import GenerationConfig

    model = _load_hf(model_dir)
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=None,
        pad_token_id=EOS_ID,
        bad_words_ids=[list(w) for w in words] if words else None,
    )
    x = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)
    return out[0, len(prompt) :].tolist()


def _holds(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def _params(words: list[str] | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, bad_words=words or [])


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_banned_words_never_appear_and_match_transformers(llama, overlap, mirrors):
    cfg = engine_config(llama, runtime={"overlap": overlap, "cpu_mirrors": mirrors})
    async with Engine(cfg) as engine:
        plain = await asyncio.gather(*(engine.complete(p, _params()) for p, _ in CASES))
        # banned and unbanned rows share batches
        banned = await asyncio.gather(
            *(engine.complete(p, _params(w)) for p, w in CASES),
            *(engine.complete(p, _params()) for p, _ in CASES),
        )
        for (prompt, words), before, after, again in zip(
            CASES, plain, banned, banned[len(CASES) :], strict=False
        ):
            assert after.error is None, after.error
            ids = engine.tokenizer.encode(prompt)
            tokens = [tuple(engine.tokenizer.encode(w, add_special_tokens=False)) for w in words]
            assert any(_holds(before.token_ids, list(t)) for t in tokens)  # the test bites
            for t in tokens:
                assert not _holds(after.token_ids, list(t)), (words, after.token_ids)
            assert after.token_ids == _hf_banned(llama, tuple(ids), tuple(tokens))
            assert again.token_ids == before.token_ids  # the other rows are untouched
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_bad_words_under_overlap_read_nothing_on_the_schedule_path(llama):
    cfg = engine_config(llama, runtime={"overlap": True, "strict": True})
    async with guarded(Engine(cfg)) as engine:
        prompt, words = CASES[1]
        r = await engine.complete(prompt, _params(words))
        assert r.error is None, r.error
        assert not _holds(r.token_ids, list(b"HK")) and not _holds(r.token_ids, list(b"}}}"))
        monitor = engine.core.monitor
        assert monitor.guard is not None and monitor.guard.violations == 0
        assert monitor.schedule_path_reads == 0 and monitor.total_stalls() == 0
        assert engine.core.scheduler.stats.overlap_steps > 0


async def test_retraction_rebuilds_the_history_where_the_host_is(llama):
    """A pool too small for every request: retracted requests are re-prefilled with their
    history rebuilt from the host's outputs; every reply still equals transformers'."""
    cfg = engine_config(
        llama,
        cache={"page_size": 4, "max_total_tokens": 200, "max_running_requests": 8},
        scheduler={"new_token_ratio": 0.05},
    )
    prompt, words = CASES[1]
    async with Engine(cfg) as engine:
        results = await asyncio.gather(*(engine.complete(prompt, _params(words)) for _ in range(8)))
        ids = engine.tokenizer.encode(prompt)
        tokens = tuple(tuple(engine.tokenizer.encode(w, add_special_tokens=False)) for w in words)
        expected = _hf_banned(llama, tuple(ids), tokens)
        for r in results:
            assert r.error is None, r.error
            assert r.token_ids == expected
        assert engine.core.scheduler.stats.retractions > 0
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_tokenization_follows_vllm_and_bounds_name_the_field(llama):
    cfg = engine_config(llama)
    async with Engine(cfg) as engine:
        v = engine.validator
        # as is (leading spaces stripped), and with a space only when that is as many tokens
        assert v.bad_words_ids(["  ab"]) == ((97, 98),)
        with pytest.raises(InvalidRequestError) as err:
            await engine.complete("x", _params(["y" * (MAX_BAD_WORD_TOKENS + 1)]))
        assert err.value.param == "bad_words"
        with pytest.raises(InvalidRequestError) as err:
            await engine.complete("x", _params(["abcdefghij" * 3] * 100))
        assert err.value.param == "bad_words"
    for bad in ([""], ["   "], ["x" * 257], ["w"] * 129):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)


def test_the_device_compare_bans_only_after_the_prefix():
    """The stream-side compare on its own: the last token is banned exactly where the
    history ends with the word's other tokens, and the history shifts in the sampled ones."""
    params = SamplingParams(bad_words=["ab"]).with_bad_words_ids(((5, 6, 7),))
    req = Req(rid="r", origin_input_ids=[1, 2], sampling_params=params, eos_token_ids=frozenset())
    req.req_pool_idx = 3
    req.output_ids = [9, 5]
    rows = BadWordsRows()
    rows.add(0, req, real=True)
    plan = rows.plan(lambda t: t)
    assert plan is not None
    state = BadWordsState(4, torch.device("cpu"))
    state.rebuild(plan)
    assert state.history[3, -2:].tolist() == [9, 5] and state.history.shape[1] == HISTORY
    logits = torch.zeros(1, 10)
    out = state.apply(logits, plan)
    assert not torch.isinf(out).any()  # history ends with 5, not 5 6
    state.record(plan, torch.tensor([6]))
    out = state.apply(logits, plan)
    assert torch.isinf(out[0, 7]) and torch.isinf(out).sum() == 1
    assert torch.equal(logits, torch.zeros(1, 10))  # out of place


@pytest.mark.slow
async def test_worker_processes_ban_as_in_process(llama):
    """The plan and the history cross the process boundary: the same replies as in process."""
    outs = []
    for worker in ("inprocess", "process"):
        cfg = engine_config(llama, runtime={"overlap": True, "worker": worker})
        async with Engine(cfg) as engine:
            results = await asyncio.gather(*(engine.complete(p, _params(w)) for p, w in CASES))
            outs.append([r.token_ids for r in results])
    assert outs[0] == outs[1]
    ids = list(CASES[1][0].encode())
    assert outs[1][1] == _hf_banned(llama, tuple(ids), ((72, 75), (125, 125, 125)))
