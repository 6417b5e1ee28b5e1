"""What `text_offset` of /v1/completions logprobs counts (docs/serving.md, Logprobs): characters
of the `tokens` strings before each token, from the choice's first token (an echoed prompt's
included) and across a stream's events. That is a position in `text` only while every earlier
token is plain text: a special token (`<s>`) is in `tokens` and not in `text`, and a byte of a
multi-byte UTF-8 character is a token written `\\xNN` where `text` has the whole character once.

On the `tiny` preset (byte tokens: 256 is `<s>`), the echoed prompt sent as token ids.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from tests.http_util import NO_EOS, completion, serving

CASES = {
    "special": ([256, 104, 105], ["<s>", "h", "i"], "hi"),
    "split-utf8": ([195, 169, 33], ["\\xc3", "\\xa9", "!"], "\u00e9!"),
    "plain": ([104, 105, 33], ["h", "i", "!"], "hi!"),
}


def offsets_of(tokens: list[str]) -> list[int]:
    return [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]


async def _stream(live: Any, body: dict[str, Any]) -> tuple[str, list[str], list[int]]:
    text, tokens, offsets = "", [], []
    async with live.http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            if choice["logprobs"] is not None:
                tokens += choice["logprobs"]["tokens"]
                offsets += choice["logprobs"]["text_offset"]
    return text, tokens, offsets


@pytest.mark.parametrize(("prompt", "prompt_tokens", "prompt_text"), CASES.values(), ids=CASES)
async def test_text_offset_counts_the_characters_of_the_tokens_before(
    prompt, prompt_tokens, prompt_text
):
    async with serving() as live:
        body = completion(prompt=prompt, echo=True, logprobs=0, max_tokens=4) | NO_EOS
        whole = (await live.http.post("/v1/completions", json=body)).json()["choices"][0]
        text, logprobs = whole["text"], whole["logprobs"]
        tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
        assert tokens[:3] == prompt_tokens and text.startswith(prompt_text)
        assert offsets == offsets_of(tokens)
        # the generated tokens continue after the prompt's token strings, not its text
        assert offsets[3] == len("".join(prompt_tokens))
        if prompt_tokens == list(prompt_text):
            assert offsets[3] == len(prompt_text)
            # plain text throughout: each offset indexes `text`
            assert all(
                text[o : o + len(t)] == t for o, t in zip(offsets[:3], prompt_tokens, strict=True)
            )
        else:
            assert offsets[3] > len(prompt_text)
        # streamed: the same tokens and offsets, continued across events
        assert await _stream(live, body) == (text, tokens, offsets)
