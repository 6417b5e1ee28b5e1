"""Small hostile inputs to the embedded API: each gets a clear error, and the engine serves on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stallfree import Engine, EngineClosedError, EngineOverloadedError, SamplingParams
from tests.engine_util import engine_config


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"0001": 1.0}, "must be written '1'"),
        ({"1": 1.0, 1: 2.0}, "token id 1 twice"),
        ({" 1": 1.0}, "must be token ids"),
        ({"-1": 1.0}, "must be token ids"),
        ({"1": "2"}, "must be numbers, not str"),
        ({"1": True}, "must be numbers, not bool"),
        ({1.5: 1.0}, "must be token ids"),
    ],
)
def test_logit_bias_keys_are_written_one_way_and_values_are_numbers(bias, message):
    with pytest.raises(ValidationError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_in_canonical_form_is_taken():
    assert SamplingParams(logit_bias={"7": 1, 8: -2.5}).logit_bias == {7: 1.0, 8: -2.5}


@pytest.mark.parametrize("penalty", [1e-300, 1e-3, 0.0099])
def test_a_repetition_penalty_that_would_overflow_the_logits_is_refused(penalty):
    with pytest.raises(ValidationError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)


async def test_a_small_repetition_penalty_at_the_floor_still_samples_real_tokens(llama):
    params = SamplingParams(max_new_tokens=8, repetition_penalty=0.01, ignore_eos=True)
    async with Engine(engine_config(llama)) as engine:
        result = await engine.complete([5, 6, 7, 5, 6, 7], params)
    # at 1e-300 every penalised logit became inf and the output was token 0 forever
    assert result.finish_reason == "length" and result.token_ids != [0] * 8


async def test_abort_with_an_id_that_cannot_be_a_request_id_is_false(llama):
    async with Engine(engine_config(llama)) as engine:
        assert engine.abort(["not", "hashable"]) is False  # type: ignore[arg-type]
        assert engine.abort({"a": 1}) is False  # type: ignore[arg-type]
        assert engine.abort("no-such-request") is False
        ok = await engine.complete([1, 2, 3], {"max_new_tokens": 2})
        assert ok.finish_reason == "length"


async def test_a_closed_engine_raises_its_own_error(llama):
    engine = Engine(engine_config(llama))
    with pytest.raises(EngineClosedError, match="not started"):
        await engine.complete([1, 2, 3], {"max_new_tokens": 2})
    async with engine:
        await engine.complete([1, 2, 3], {"max_new_tokens": 2})
    with pytest.raises(EngineClosedError, match="shut down") as info:
        await engine.complete([1, 2, 3], {"max_new_tokens": 2})
    assert isinstance(info.value, EngineOverloadedError)  # callers that retry elsewhere still do
