"""`--generation-config`: the model's generation_config.json supplies the sampling fields a
request leaves unset, and extra stop ids; `vllm` ignores it; a file the server cannot use
stops the start-up with a message."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from stallfree import Engine
from stallfree.entrypoints.server import create_app, start_server
from tests.engine_util import engine_config

PROMPT = [5, 9, 13, 21, 34]


def _copy_with(llama: str, tmp_path: Path, generation: dict) -> str:
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    (model / "generation_config.json").write_text(json.dumps(generation))
    return str(model)


async def _complete(model: str, setting: str, **body) -> dict:
    config = engine_config(
        model,
        server={"served_model_name": "m", "generation_config": setting},
        runtime={"check_mirrors": False},
    )
    engine = Engine(config)
    server = await start_server(create_app(engine))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            request = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "seed": 1, **body}
            answer = await http.post("/v1/completions", json=request)
            assert answer.status_code == 200, answer.text
            return answer.json()
    finally:
        await server.stop()
        await engine.shutdown()


async def test_the_models_defaults_fill_unset_fields(llama, tmp_path, caplog):
    greedy = await _complete(llama, "auto", temperature=0, ignore_eos=True)
    model = _copy_with(llama, tmp_path, {"temperature": 0.0, "top_k": 0, "bos_token_id": 1})
    with caplog.at_level(logging.INFO, logger="stallfree.server"):
        by_model = await _complete(model, "auto", ignore_eos=True)
    # the model says greedy: a request without a temperature is greedy
    assert by_model["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert any("sampling defaults from the model" in r.message for r in caplog.records)
    # the request's own value wins, and `vllm` ignores the file (temperature 1, seeded)
    hot = await _complete(model, "auto", temperature=1.0, ignore_eos=True)
    ignored = await _complete(model, "vllm", ignore_eos=True)
    assert hot["choices"][0]["text"] == ignored["choices"][0]["text"]
    assert ignored["choices"][0]["text"] != greedy["choices"][0]["text"]


async def test_extra_eos_ids_stop_the_output(llama, tmp_path):
    from tests.hf_models import hf_greedy

    tokens = hf_greedy(Path(llama), PROMPT, 8)  # what the engine writes greedily, too
    # the first token whose first appearance is not at the start becomes an end of sequence
    at = next(i for i, t in enumerate(tokens) if i > 0 and tokens.index(t) == i)
    model = _copy_with(llama, tmp_path, {"eos_token_id": [tokens[at]]})
    stopped = await _complete(model, "auto", temperature=0)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == at + 1
    # ignore_eos ignores those too, and `vllm` never reads them
    assert (await _complete(model, "auto", temperature=0, ignore_eos=True))["usage"][
        "completion_tokens"
    ] == 8
    assert (await _complete(model, "vllm", temperature=0))["usage"]["completion_tokens"] == 8


def test_a_file_the_server_cannot_use_stops_the_start(llama, tmp_path):
    model = _copy_with(llama, tmp_path, {"temperature": -3})
    for path, setting, message in [
        (model, "auto", "generation_config.json holds sampling defaults"),
        (llama, str(tmp_path), "no generation_config.json"),
    ]:
        engine = Engine(engine_config(path, server={"generation_config": setting}))
        with pytest.raises(ValueError, match=message):
            create_app(engine)
        asyncio.run(engine.shutdown())
