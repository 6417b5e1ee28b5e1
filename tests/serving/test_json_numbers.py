"""Numbers a JSON body cannot hold are a 400 naming the field on every JSON route, never a 500:
an integer longer than Python converts (`sys.get_int_max_str_digits`, 4,300 digits; issue 42,
finding 10), and floats beyond the double range (read as infinity) in fields that take numbers.
On the event loop, in the worker thread (a large body) and in the screening process (a large
dense body)."""

from __future__ import annotations

import sys

import pytest

from tests.server_util import Live, module_loop

pytestmark = module_loop

LIMIT = sys.get_int_max_str_digits()
HUGE = "1" + "0" * LIMIT  # one digit past the limit
HUGE_NEG = "-" + "9" * (LIMIT + 500)
COMPLETION = '{"model":"test-model","prompt":"hi","max_tokens":2,%s}'
CHAT = '{"model":"test-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2,%s}'
GENERATE = '{"text":"hi","sampling_params":{"max_new_tokens":2,%s}}'

# (route, body template, the field as the body holds it, the field as the error names it)
INT_FIELDS = [
    ("/v1/completions", COMPLETION, '"max_tokens":%s', "max_tokens"),
    ("/v1/completions", COMPLETION, '"seed":%s', "seed"),
    ("/v1/completions", COMPLETION, '"temperature":%s', "temperature"),
    ("/v1/completions", COMPLETION, '"logit_bias":{"5":%s}', "logit_bias.5"),
    ("/v1/completions", COMPLETION, '"not_a_field":[0,{"a":%s}]', "not_a_field.1.a"),
    ("/v1/completions", '{"model":"test-model","prompt":[1,2,%s]}', None, "prompt.2"),
    ("/v1/chat/completions", CHAT, '"n":%s', "n"),
    ("/v1/chat/completions", CHAT, '"top_logprobs":%s', "top_logprobs"),
    ("/v1/chat/completions", CHAT, '"frequency_penalty":%s', "frequency_penalty"),
    (
        "/tokenize",
        '{"model":"test-model","prompt":"hi","add_special_tokens":%s}',
        None,
        "add_special_tokens",
    ),
    ("/detokenize", '{"model":"test-model","tokens":[1,%s]}', None, "tokens.1"),
    ("/abort_request", '{"rid":"x","timeout":%s}', None, "timeout"),
    ("/abort_requests", '{"request_ids":["x"],"x":%s}', None, "x"),
    ("/generate", GENERATE, '"top_k":%s', "sampling_params.top_k"),
    ("/v1/completions", "%s", None, "body"),
]


def _body(template: str, field: str | None, number: str) -> str:
    return template % (field % number) if field is not None else template % number


async def _post(live: Live, route: str, body: str | bytes) -> tuple[int, dict]:
    answer = await live.http.post(route, content=body, headers={"content-type": "application/json"})
    return answer.status_code, answer.json()


@pytest.mark.parametrize("number", [HUGE, HUGE_NEG], ids=["huge", "huge-negative"])
@pytest.mark.parametrize(("route", "template", "field", "param"), INT_FIELDS)
async def test_an_integer_past_the_digit_limit_is_a_400_naming_the_field(
    live: Live, route: str, template: str, field: str | None, param: str, number: str
) -> None:
    status, answer = await _post(live, route, _body(template, field, number))
    assert status == 400, answer
    digits = len(number.lstrip("-"))
    assert answer["error"]["param"] == param
    assert answer["error"]["message"] == (
        f"{param}: a number of {digits} digits is too long "
        f"(integers may have at most {LIMIT} digits)"
    )


async def test_an_integer_at_the_digit_limit_parses(live: Live) -> None:
    """4,300 digits convert: the body is read, and the field's own check refuses the value."""
    status, answer = await _post(live, "/v1/completions", COMPLETION % f'"seed":{"9" * LIMIT}')
    assert status == 400, answer
    assert answer["error"]["param"] == "seed"
    assert "digits is too long" not in answer["error"]["message"]


FLOAT_FIELDS = [
    ("/v1/completions", COMPLETION, '"temperature":%s', "temperature"),
    ("/v1/completions", COMPLETION, '"top_p":%s', "top_p"),
    ("/v1/completions", COMPLETION, '"max_tokens":%s', "max_tokens"),
    ("/v1/completions", COMPLETION, '"seed":%s', "seed"),
    ("/v1/completions", COMPLETION, '"logit_bias":{"5":%s}', "logit_bias"),
    ("/v1/chat/completions", CHAT, '"presence_penalty":%s', "presence_penalty"),
    ("/v1/chat/completions", CHAT, '"n":%s', "n"),
    ("/v1/chat/completions", CHAT, '"top_logprobs":%s', "top_logprobs"),
    ("/generate", GENERATE, '"temperature":%s', "sampling_params.temperature"),
    ("/generate", GENERATE, '"min_p":%s', "sampling_params.min_p"),
    ("/detokenize", '{"model":"test-model","tokens":[1,%s]}', None, "tokens.1"),
]
HUGE_FLOATS = [HUGE + ".5", "-" + HUGE + ".5", "1e400", "-1e400", "1" + "0" * 400 + "e-1"]


@pytest.mark.parametrize("number", HUGE_FLOATS, ids=["long", "long-neg", "exp", "neg-exp", "int"])
@pytest.mark.parametrize(("route", "template", "field", "param"), FLOAT_FIELDS)
async def test_a_float_past_the_double_range_is_a_400_naming_the_field(
    live: Live, route: str, template: str, field: str | None, param: str, number: str
) -> None:
    status, answer = await _post(live, route, _body(template, field, number))
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


async def test_a_long_integer_in_a_large_body_is_a_400(live: Live) -> None:
    """Bodies of 64 KB or more are parsed off the event loop: a long text in a worker thread,
    a dense one in the screening process; each names the field too."""
    pad = "x" * 70_000
    long_text = COMPLETION % f'"suffix_pad":"{pad}","seed":{HUGE}'
    ones = ",".join(["1"] * 40_000)
    dense = '{"model":"test-model","prompt":[' + ones + '],"max_tokens":2,"seed":' + HUGE + "}"
    for body in (long_text, dense):
        status, answer = await _post(live, "/v1/completions", body)
        assert status == 400, answer
        assert answer["error"]["param"] == "seed"
        assert "digits is too long" in answer["error"]["message"]
    huge_number = COMPLETION % f'"seed":{"7" * 70_000}'
    status, answer = await _post(live, "/v1/completions", huge_number)
    assert (status, answer["error"]["param"]) == (400, "seed")


async def test_malformed_json_after_a_long_integer_is_a_400(live: Live) -> None:
    status, answer = await _post(live, "/v1/completions", '{"seed":' + HUGE + ',"x":}')
    assert status == 400, answer
    assert answer["error"]["param"] == "body"
    assert answer["error"]["message"].startswith("malformed JSON body: Expecting value")


async def test_deep_nesting_after_a_long_integer_is_a_400(live: Live) -> None:
    body = '{"seed":' + HUGE + ',"x":' + "[" * 100_000 + "]" * 100_000 + "}"
    status, answer = await _post(live, "/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == "body"


async def test_a_long_key_is_shown_cut(live: Live) -> None:
    key = "k" * 100_000
    status, answer = await _post(live, "/v1/completions", '{"' + key + '":' + HUGE + "}")
    assert status == 400, answer
    assert answer["error"]["param"] == "k" * 200 + "..."


async def test_the_server_serves_on(live: Live) -> None:
    for _ in range(3):
        await _post(live, "/v1/completions", COMPLETION % f'"seed":{HUGE}')
    status, answer = await _post(live, "/v1/completions", COMPLETION % '"seed":1')
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 2
