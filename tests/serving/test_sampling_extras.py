"""vLLM's `bad_words`, `skip_special_tokens`, `spaces_between_special_tokens` and
`prompt_logprobs` through the HTTP API: the engine's outputs reach `/v1` and `/generate`,
special tokens kept in the text equal transformers' decode (streamed deltas add up to the whole),
prompt logprobs equal transformers' log-softmax and are shared by a prompt's `n` choices, and
abusive values are 400s naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from stallfree import SamplingParams
from tests.hf_models import hf_logits
from tests.server_util import module_loop

GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
PROMPT = "abc"  # its greedy reply holds "HK" (tests/engine/test_bad_words.py)
BOS = 256


def _holds(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids) - len(word) + 1))


async def _post(live, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await live.http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _streamed_text(live, path: str, body: dict[str, Any]) -> str:
    async with live.http.stream("POST", path, json=body | {"stream": True}) as s:
        lines = [line async for line in s.aiter_lines() if line.startswith("data: {")]
    events = [json.loads(line[6:]) for line in lines]
    if path == "/generate":
        return "".join(e["text"] for e in events)
    return "".join(c["text"] for e in events for c in e["choices"])


# ---------------------------------------------------------------- bad_words


@module_loop
async def test_bad_words_reach_both_routes(live):
    plain = await live.engine.complete(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert _holds(plain.token_ids, list(b"HK"))  # the test bites
    banned = await live.engine.complete(
        PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True, bad_words=["HK"])
    )
    assert not _holds(banned.token_ids, list(b"HK"))
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 24, "bad_words": ["HK"]}
    out = await _post(live, "/v1/completions", body | GREEDY)
    assert out["choices"][0]["text"] == banned.text
    native = {"max_new_tokens": 24, "ignore_eos": True, "bad_words": ["HK"]}
    gen = await _post(live, "/generate", {"text": PROMPT, "sampling_params": native})
    assert gen["output_ids"] == banned.token_ids
    chat = await live.client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"bad_words": ["x"], "ignore_eos": True},
        temperature=0.0,
    )
    assert "x" not in (chat.choices[0].message.content or "")


@module_loop
@pytest.mark.parametrize(
    "bad",
    [[""], ["  "], ["w"] * 129, ["y" * 33], ["abcdefghijklmnopqrstuvwxyz012345"] * 100, "HK", [7]],
    ids=["empty", "blank", "too-many", "too-long", "too-many-tokens", "not-a-list", "not-str"],
)
async def test_abusive_bad_words_are_400_naming_the_field(live, bad):
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 2, "bad_words": bad}
    r = await live.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("bad_words")  # or the item: bad_words.0
    gen = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "bad_words": bad}}
    r = await live.http.post("/generate", json=gen)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("sampling_params.bad_words")


# ---------------------------------------------------------------- special tokens


@module_loop
@pytest.mark.parametrize("spaces", [True, False])
async def test_kept_special_tokens_equal_transformers_streamed_and_whole(live, llama, spaces):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(llama)
    # a bias that makes <s> come up among the bytes
    native = {
        "max_new_tokens": 24,
        "ignore_eos": True,
        "logit_bias": {str(BOS): 3.0},
        "skip_special_tokens": False,
        "spaces_between_special_tokens": spaces,
    }
    gen = await _post(live, "/generate", {"text": PROMPT, "sampling_params": native})
    ids = gen["output_ids"]
    assert BOS in ids and any(t < 256 for t in ids)  # the test bites
    want = ref.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert "<s>" in want and gen["text"] == want
    assert await _streamed_text(live, "/generate", {"text": PROMPT, "sampling_params": native}) == (
        want
    )
    body = {
        "model": "test-model",
        "prompt": PROMPT,
        "max_tokens": 24,
        "logit_bias": {str(BOS): 3.0},
        "skip_special_tokens": False,
        "spaces_between_special_tokens": spaces,
    } | GREEDY
    out = await _post(live, "/v1/completions", body)
    assert out["choices"][0]["text"] == want
    assert await _streamed_text(live, "/v1/completions", body) == want
    skipped = await _post(live, "/v1/completions", body | {"skip_special_tokens": True})
    assert skipped["choices"][0]["text"] == ref.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- prompt_logprobs


def _log_softmax(path: str, ids: list[int]):
    import torch

    return torch.log_softmax(hf_logits(path, ids), dim=-1)  # type: ignore[arg-type]


def _check_prompt_logprobs(entries: list[Any], ids: list[int], k: int, want) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for j, entry in enumerate(entries[1:], start=1):
        own = entry[str(ids[j])]
        assert math.isclose(own["logprob"], float(want[j - 1, ids[j]]), abs_tol=1e-4)
        assert own["decoded_token"] == bytes([ids[j]]).decode("utf-8", "backslashreplace")
        top = want[j - 1].topk(k).indices.tolist()
        assert set(entry) == {str(ids[j]), *map(str, top)}
        for rank, alt in enumerate(top, start=1):
            got = entry[str(alt)]
            assert got["rank"] == rank
            assert math.isclose(got["logprob"], float(want[j - 1, alt]), abs_tol=1e-4)
        if ids[j] not in top:
            assert own["rank"] is None


@module_loop
async def test_prompt_logprobs_equal_transformers_and_are_shared_by_n_choices(live, llama):
    prompt = "The quick brown fox"
    ids = list(prompt.encode())
    want = _log_softmax(llama, ids)
    body = {
        "model": "test-model",
        "prompt": prompt,
        "max_tokens": 3,
        "n": 3,
        "prompt_logprobs": 3,
        "temperature": 0.8,
        "seed": 5,
    }
    out = await _post(live, "/v1/completions", body)
    choices = out["choices"]
    assert len(choices) == 3
    for c in choices:
        _check_prompt_logprobs(c["prompt_logprobs"], ids, 3, want)
        assert c["prompt_logprobs"] == choices[0]["prompt_logprobs"]
    # 0: the prompt's own token alone; with echo and logprobs, the echo keeps its own count
    zero = await _post(live, "/v1/completions", body | {"n": 1, "prompt_logprobs": 0})
    _check_prompt_logprobs(zero["choices"][0]["prompt_logprobs"], ids, 0, want)
    echoed = await _post(
        live, "/v1/completions", body | {"n": 1, "echo": True, "logprobs": 1, "prompt_logprobs": 4}
    )
    choice = echoed["choices"][0]
    _check_prompt_logprobs(choice["prompt_logprobs"], ids, 4, want)
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(1 <= len(t) <= 2 for t in tops[1:])
    plain = await _post(live, "/v1/completions", body | {"prompt_logprobs": None})
    assert "prompt_logprobs" not in plain["choices"][0]


@module_loop
async def test_chat_prompt_logprobs_cover_the_rendered_prompt_for_every_choice(live, llama):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = (await _post(live, "/tokenize", {"messages": messages}))["tokens"]
    want = _log_softmax(llama, ids)
    body = {"model": "test-model", "messages": messages, "max_tokens": 2, "n": 2,
            "prompt_logprobs": 2, "temperature": 0.8, "seed": 1}  # fmt: skip
    choices = (await _post(live, "/v1/chat/completions", body))["choices"]
    assert len(choices) == 2
    for c in choices:
        _check_prompt_logprobs(c["prompt_logprobs"], ids, 2, want)
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    plain = await _post(live, "/v1/chat/completions", body | {"prompt_logprobs": None})
    assert "prompt_logprobs" not in plain["choices"][0]


@module_loop
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ],
)
async def test_bad_prompt_logprobs_are_400_naming_the_field(live, extra, param):
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 2} | extra
    r = await live.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]} | extra
    r = await live.http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_prompt_logprobs_count_toward_the_request_cost(llama):
    """n choices each holding every prompt token and its top k: over the budget, a 400 naming
    prompt_logprobs; the same request without them is served."""
    from tests.server_util import serving

    prompt = "x" * 50
    body = {"model": "test-model", "prompt": prompt, "max_tokens": 1, "n": 4}
    async with serving(llama, server={"max_request_cost": 1000}) as live:
        ok = await live.http.post("/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        r = await live.http.post("/v1/completions", json=body | {"prompt_logprobs": 5})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt_logprobs" and error["code"] == "request_too_costly"
        assert "prompt_logprobs 5" in error["message"]
