"""A model whose chat template cannot be used: an error at start-up that names the reason, a
400 naming it on each chat request, and the server goes on serving everything else."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import openai
import pytest

from tests.server_util import serving

BROKEN = {
    # does not compile: the expression is never closed
    "invalid chat template": "{% for m in messages %}{{ m['content'] }{% endfor %}",
    # compiles, and refuses every conversation
    "failed to render: this template refuses every chat": (
        "{{ raise_exception('this template refuses every chat') }}"
    ),
}


def _with_template(llama: str, tmp_path: Path, template: str) -> str:
    out = tmp_path / "llama"
    shutil.copytree(llama, out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("reason", list(BROKEN))
async def test_a_bad_template_is_a_400_naming_the_reason_and_the_server_serves_on(
    llama: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    model = _with_template(llama, tmp_path, BROKEN[reason])
    with caplog.at_level(logging.ERROR, logger="stallfree.runtime.engine"):
        async with serving(model) as s:
            for _ in range(2):  # refused each time, not only the first
                with pytest.raises(openai.BadRequestError, match=reason) as info:
                    await s.client.chat.completions.create(
                        model="test-model", messages=[{"role": "user", "content": "hi"}]
                    )
                assert info.value.status_code == 400
            ok = await s.client.completions.create(model="test-model", prompt="plain", max_tokens=2)
            assert ok.usage is not None and ok.usage.completion_tokens == 2
            assert (await s.http.get("/health")).status_code == 200
    startup = [
        r.getMessage() for r in caplog.records if "chat requests will be refused" in r.getMessage()
    ]
    if reason == "invalid chat template":
        assert len(startup) == 1 and reason in startup[0]
    else:  # it compiles: nothing to say until a chat renders it
        assert startup == []
