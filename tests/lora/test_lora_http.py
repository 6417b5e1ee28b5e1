"""LoRA over HTTP as vLLM serves it: the adapter as the `model` field, `/v1/models` listing
adapters with their parent, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, 404 for an
unknown name and 400 naming why a load is refused; vLLM's flag spellings."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import pytest_asyncio

from stallfree.entrypoints.cli import build_parser, config_from_args
from tests.lora_models import ADAPTERS, make_adapter, merged_greedy
from tests.server_util import module_loop, serving

N = 12
PROMPTS = [[5, 17, 99, 3, 42, 8], [200, 1, 64, 64, 7], [11, 12, 13, 14, 15, 16, 17], [90, 4]]


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(make_adapter(llama, root / name, seed=i, **cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(llama, adapters):
    first = "attn-r4"
    lora = {"lora_modules": [{"name": first, "path": adapters[first]}], "max_loras": 2}
    async with serving(llama, lora=lora) as server:
        yield server


@module_loop
async def test_models_list_adapters_with_their_parent(live):
    cards = (await live.http.get("/v1/models")).json()["data"]
    assert [c["id"] for c in cards] == ["test-model", "attn-r4"]
    assert cards[1]["parent"] == "test-model" and "parent" not in cards[0]
    one = (await live.http.get("/v1/models/attn-r4")).json()
    assert one["id"] == "attn-r4" and one["root"].endswith("attn-r4")


@module_loop
async def test_adapters_by_model_field_equal_merged_peft(live, llama, adapters):
    for name in ("fused-r8", "mlp-r16-rs"):
        r = await live.http.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapters[name]}
        )
        assert r.status_code == 200, r.text
        assert r.text == f"Success: LoRA adapter '{name}' added successfully."
    names = [*ADAPTERS, "test-model"]
    replies = await asyncio.gather(
        *(
            live.client.completions.create(
                model=names[i % 4],
                prompt=p,
                max_tokens=N,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for i, p in enumerate(PROMPTS)
        )
    )
    for i, (p, reply) in enumerate(zip(PROMPTS, replies, strict=True)):
        assert reply.model == names[i % 4]
        want = merged_greedy(llama, adapters.get(names[i % 4]), p, N)
        assert reply.choices[0].text == live.engine.tokenizer.decode(want), names[i % 4]


@module_loop
async def test_unknown_names_are_404_and_bad_loads_400(live, tmp_path):
    with pytest.raises(openai.NotFoundError) as err:
        await live.client.completions.create(model="nope", prompt=[1, 2], max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    r = await live.http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    bad = {
        str(tmp_path): "is not a LoRA adapter",
        "/no/such/dir": "is not a LoRA adapter",
    }
    for path, reason in bad.items():
        r = await live.http.post(
            "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}
        )
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    r = await live.http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400  # lora_path missing
    await live.engine.wait_idle()
    assert live.engine.pool_usage().all_free
    assert live.engine.lora.held() == 0 and "bad" not in live.engine.lora.adapters


@module_loop
async def test_unload_then_the_name_is_gone(live, adapters):
    r = await live.http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp-r16-rs"})
    assert r.status_code == 200, r.text
    ids = [c["id"] for c in (await live.http.get("/v1/models")).json()["data"]]
    assert "mlp-r16-rs" not in ids
    with pytest.raises(openai.NotFoundError):
        await live.client.completions.create(model="mlp-r16-rs", prompt=[1, 2], max_tokens=2)


def test_vllm_lora_flags_fill_the_lora_section():
    argv = [
        "serve", "--model", "tiny", "--enable-lora", "--lora-modules", "a=/x",
        json.dumps({"name": "b", "path": "/y", "base_model_name": "tiny"}),
        "--max-loras", "2", "--max-lora-rank", "64", "--max-cpu-loras", "3",
    ]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv)).lora
    assert cfg.enable_lora and cfg.max_loras == 2 and cfg.max_lora_rank == 64
    assert cfg.max_cpu_loras == 3
    assert [(m.name, m.path, m.base_model_name) for m in cfg.lora_modules] == [
        ("a", "/x", None),
        ("b", "/y", "tiny"),
    ]


@pytest.mark.parametrize(
    "item", ["no-equals", "=path", '{"name": "a"}', '{"name": "a", "path": "p", "x": 1}']
)
def test_bad_lora_modules_are_usage_errors(item, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--lora-modules", item])
    assert exc.value.code == 2
    assert "--lora-modules" in capsys.readouterr().err


@module_loop
async def test_chat_and_streams_run_under_the_adapter(live, llama, adapters):
    """Chat completions and streamed completions pick the adapter by model too."""
    messages = [{"role": "user", "content": "hi"}]
    base = await live.client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=N, temperature=0
    )
    tuned = await live.client.chat.completions.create(
        model="attn-r4", messages=messages, max_tokens=N, temperature=0
    )
    assert tuned.model == "attn-r4"
    assert tuned.choices[0].message.content != base.choices[0].message.content
    prompt = PROMPTS[0]
    stream = await live.client.completions.create(
        model="attn-r4", prompt=prompt, max_tokens=N, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    want = merged_greedy(llama, adapters["attn-r4"], prompt, N)
    assert text == live.engine.tokenizer.decode(want)


def test_a_refused_lora_module_stops_serve_with_one_line(tmp_path, capsys):
    from stallfree.entrypoints.cli import run

    args = build_parser().parse_args(
        ["serve", "--model", "tiny", "--device", "cpu", "--lora-modules", f"bad={tmp_path}"]
    )
    assert run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == f"stallfree: {str(tmp_path)!r} is not a LoRA adapter: it has no adapter_config.json"
    )
