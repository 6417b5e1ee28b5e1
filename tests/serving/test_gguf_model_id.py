"""A GGUF server's model id is the file's name: the directory it sits in shows nowhere a client
or a scrape can read it (`/v1/models`, the metrics' `model_name` label, error texts)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from stallfree import Engine
from stallfree.config.settings import ServerConfig
from stallfree.entrypoints.server import create_app, start_server
from stallfree.entrypoints.server.intake.screening import check_model
from tests.engine_util import engine_config
from tests.hf_models import make_llama
from tests.model.test_gguf import write_gguf
from tests.server_util import Live, module_loop

NAME = "tiny-q.GGUF"


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    secret = tmp_path_factory.mktemp("secret-models-dir")
    return write_gguf(make_llama(secret), secret / NAME)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gguf_live(gguf_path: Path) -> AsyncIterator[Live]:
    import httpx

    engine = Engine(engine_config(str(gguf_path)))
    server = await start_server(create_app(engine))
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    try:
        yield Live(engine, server, client, http)
    finally:
        await client.close()
        await http.aclose()
        await server.stop()
        await engine.shutdown()


def _no_path(text: str, gguf_path: Path) -> None:
    assert str(gguf_path.parent) not in text and "secret-models-dir" not in text, text


@module_loop
async def test_the_served_id_is_the_file_name(gguf_live, gguf_path):
    models = await gguf_live.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    r = await gguf_live.client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert r.model == NAME
    scrape = (await gguf_live.http.get("/metrics")).text
    labels = set(re.findall(r'model_name="([^"]*)"', scrape))
    assert labels == {NAME}
    _no_path(scrape, gguf_path)


@module_loop
async def test_no_error_text_names_the_models_directory(gguf_live, gguf_path):
    for model in ("other", str(gguf_path)):  # the old id, the absolute path, is not one
        with pytest.raises(openai.NotFoundError) as info:
            await gguf_live.client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        message = info.value.body["message"]  # type: ignore[index]
        assert f"it is {NAME!r}" in message
        _no_path(message.replace(str(gguf_path), "<the client's own text>"), gguf_path)
    bad = await gguf_live.http.get("/v1/models/nope")
    assert bad.status_code == 404
    _no_path(bad.text, gguf_path)


def test_a_directory_served_under_its_path_is_not_named_in_an_error(tmp_path):
    served = ServerConfig().model_name(str(tmp_path))
    assert served == str(tmp_path)  # a directory keeps the name it was given, as in vLLM
    with pytest.raises(Exception) as info:
        check_model(served, "other")
    assert str(tmp_path) not in str(info.value) and "GET /v1/models" in str(info.value)
    assert ServerConfig(served_model_name="m").model_name("/a/b.gguf") == "m"
    assert ServerConfig().model_name("/a/b/model-q8_0.gguf") == "model-q8_0.gguf"
