"""Structured outputs on a GPU (skipped without CUDA): with the model in a worker process on
CUDA, strict overlap and mirrors, sampled and greedy JSON-schema replies and a forced tool call
conform and the schedule path reads nothing; the in-process CUDA stream refuses a constrained
request with a clear `unsupported` error naming `--worker process`."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from stallfree import Engine, InvalidRequestError, SamplingParams
from stallfree.entrypoints.server.chat.tool_parsers import PARSERS
from tests.engine_util import engine_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
    "required": ["city"],
}
CALL = PARSERS["hermes"]().forced_grammar([("get_weather", ARGS)], many=False)


def _person(text: str) -> bool:
    value = json.loads(text)
    return (
        list(value) == ["name", "age", "ok"]
        and re.fullmatch("[a-z]{1,8}", value["name"]) is not None
        and type(value["age"]) is int
        and 0 <= value["age"] <= 120
        and type(value["ok"]) is bool
    )


async def test_a_cuda_worker_process_constrains_replies(llama):
    runtime = {"device": "cuda", "overlap": True, "strict": True, "worker": "process"}
    async with Engine(engine_config(llama, runtime=runtime)) as engine:
        spec = {"json": SCHEMA}
        params = [
            SamplingParams(max_new_tokens=80, temperature=1.0, seed=s, structured_outputs=spec)
            for s in range(8)
        ]
        params.append(SamplingParams(max_new_tokens=80, structured_outputs=spec))
        results = await asyncio.gather(
            *(engine.complete(f"P{i}:", p) for i, p in enumerate(params))
        )
        for r in results:
            assert r.error is None and r.finish_reason == "stop", (r.error, r.text)
            assert _person(r.text), r.text
        call = await engine.complete(
            "Weather?", SamplingParams(max_new_tokens=160, structured_outputs={"grammar": CALL})
        )
        assert call.finish_reason == "stop", call.text
        body = json.loads(call.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert body["name"] == "get_weather" and list(body["arguments"]) == ["city"]
        assert engine.core.monitor.schedule_path_reads == 0


async def test_the_in_process_cuda_stream_refuses_with_a_clear_error(llama):
    async with Engine(engine_config(llama, runtime={"device": "cuda"})) as engine:
        with pytest.raises(InvalidRequestError, match="--worker process") as err:
            await engine.complete("x", SamplingParams(structured_outputs={"choice": ["a"]}))
        assert err.value.code == "unsupported"
        ok = await engine.complete("x", SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert ok.error is None and len(ok.token_ids) == 4
