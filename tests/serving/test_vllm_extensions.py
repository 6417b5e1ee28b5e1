"""vLLM's additions to the OpenAI API, with the official `openai` client: usage on every chunk
(`stream_options.continuous_usage_stats`), assistant prefill (`continue_final_message`,
`add_generation_prompt: false`) and `finish_reason: "abort"`; and what the server's log says:
a time on every line, and a warning when a request's tools cannot reach the model."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from stallfree.entrypoints.server import create_app
from stallfree.entrypoints.server.launch import configure_logging, uvicorn_config
from tests.engine_util import engine_config
from tests.http_util import NO_EOS, SLOW, stallfree_serve, warnings_logged
from tests.server_util import Live, module_loop, serving

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def slow(llama: str) -> AsyncIterator[Live]:
    """A server whose steps are slow enough to abort a request while it runs."""
    async with serving(llama, faults=SLOW) as live:
        yield live


# ---------------------------------------------------------------- continuous usage


@module_loop
async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(live):
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = await live.client.completions.create(
        model="test-model", prompt="hello", max_tokens=6, stream=True,
        stream_options=options, extra_body=NO_EOS,  # type: ignore[arg-type]
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert all(c.usage is not None for c in chunks), [c.usage for c in chunks]
    counts = [c.usage.completion_tokens for c in chunks if c.choices]  # type: ignore[union-attr]
    assert counts == sorted(counts) and counts[-1] == 6
    prompts = {c.usage.prompt_tokens for c in chunks}  # type: ignore[union-attr]
    assert len(prompts) == 1 and prompts.pop() > 0
    assert chunks[-1].usage == chunks[-2].usage  # the usage chunk: the last choice chunk's
    # chat: the role chunk carries the prompt's tokens and none generated yet
    stream = await live.client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, stream_options=options, extra_body=NO_EOS,  # type: ignore[arg-type]
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert all(c.usage is not None for c in chunks)
    first, last = chunks[0].usage, chunks[-1].usage
    assert first is not None and last is not None
    assert first.completion_tokens == 0 and first.prompt_tokens == last.prompt_tokens > 0
    assert last.completion_tokens == 5 and last.total_tokens == last.prompt_tokens + 5
    # without it, only the last chunk has usage
    stream = await live.client.completions.create(
        model="test-model", prompt="hello", max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


# ---------------------------------------------------------------- assistant prefill


PREFILL = [
    {"role": "user", "content": "Name a city."},
    {"role": "assistant", "content": "The city is"},
]


@module_loop
async def test_an_assistant_prefill_continues_the_final_message_as_transformers_renders_it(
    live, llama
):
    from transformers import AutoTokenizer

    original = live.engine.tokenizer.chat_template
    live.engine.tokenizer.chat_template = CHATML
    try:
        reference = AutoTokenizer.from_pretrained(llama)
        reference.chat_template = CHATML
        want = reference.apply_chat_template(
            PREFILL, continue_final_message=True, add_generation_prompt=False
        )
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        fields = {"continue_final_message": True, "add_generation_prompt": False}
        tokenized = await live.http.post("/tokenize", json={"messages": PREFILL} | fields)
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == want
        assert live.engine.tokenizer.decode(want).endswith("assistant\nThe city is")
        # the chat route generates from that prompt: as a plain completion of its ids does
        chat = await live.client.chat.completions.create(
            model="test-model", messages=PREFILL, max_tokens=6, temperature=0,  # type: ignore[arg-type]
            extra_body=fields | NO_EOS,
        )  # fmt: skip
        assert chat.usage is not None and chat.usage.prompt_tokens == len(want)
        plain = await live.client.completions.create(
            model="test-model", prompt=want, max_tokens=6, temperature=0, extra_body=NO_EOS
        )
        assert chat.choices[0].message.content == plain.choices[0].text
        # add_generation_prompt left unset means false with continue_final_message, as a
        # client that only knows the one field sends it
        alone = await live.client.chat.completions.create(
            model="test-model", messages=PREFILL, max_tokens=6, temperature=0,  # type: ignore[arg-type]
            extra_body={"continue_final_message": True} | NO_EOS,
        )  # fmt: skip
        assert alone.choices[0].message.content == plain.choices[0].text
    finally:
        live.engine.tokenizer.chat_template = original


NO_TURN = [
    {"role": "user", "content": "Name a city."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Another."},
]


def _prompt_ids_from_logprobs(chat: object) -> list[int]:
    # vLLM's prompt_logprobs: None for the first token, then {token id: ...} with the prompt's
    # own token first (prompt_logprobs 0 asks for it alone)
    entries = chat.choices[0].model_extra["prompt_logprobs"]  # type: ignore[attr-defined]
    assert entries[0] is None
    return [int(next(iter(e))) for e in entries[1:]]


@module_loop
async def test_add_generation_prompt_false_alone_renders_the_chat_without_the_assistant_turn(
    live, llama
):
    """vLLM renders the template with add_generation_prompt=False and generates from there."""
    from transformers import AutoTokenizer

    original = live.engine.tokenizer.chat_template
    live.engine.tokenizer.chat_template = CHATML
    try:
        reference = AutoTokenizer.from_pretrained(llama)
        reference.chat_template = CHATML
        want = reference.apply_chat_template(NO_TURN, add_generation_prompt=False)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        with_turn = reference.apply_chat_template(NO_TURN, add_generation_prompt=True)
        with_turn = list(with_turn["input_ids"] if hasattr(with_turn, "keys") else with_turn)
        assert len(with_turn) > len(want)  # the template does open a turn when asked
        assert live.engine.tokenizer.decode(want).endswith("Another.<|im_end|>\n")
        fields = {"add_generation_prompt": False}
        tokenized = await live.http.post("/tokenize", json={"messages": NO_TURN} | fields)
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == want
        body = {"model": "test-model", "messages": NO_TURN, "max_tokens": 6} | fields
        rendered = await live.http.post("/v1/chat/completions/render", json=body)
        assert rendered.status_code == 200, rendered.text
        assert rendered.json()[1][0]["prompt_token_ids"] == want
        plain = await live.client.completions.create(
            model="test-model", prompt=want, max_tokens=6, temperature=0, extra_body=NO_EOS
        )
        chat = await live.client.chat.completions.create(
            model="test-model", messages=NO_TURN, max_tokens=6, temperature=0,  # type: ignore[arg-type]
            extra_body=fields | NO_EOS | {"prompt_logprobs": 0},
        )  # fmt: skip
        assert chat.usage is not None and chat.usage.prompt_tokens == len(want)
        assert _prompt_ids_from_logprobs(chat) == want[1:]
        assert chat.choices[0].message.content == plain.choices[0].text
        stream = await live.client.chat.completions.create(
            model="test-model", messages=NO_TURN, max_tokens=6, temperature=0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True}, extra_body=fields | NO_EOS,
        )  # fmt: skip
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == plain.choices[0].text
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(want)
    finally:
        live.engine.tokenizer.chat_template = original


PREFILL_REFUSED = [
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"continue_final_message": True, "messages": [*PREFILL[:1], {"role": "assistant",
      "content": ""}]}, "continue_final_message"),
    ({"continue_final_message": "maybe"}, "continue_final_message"),
]  # fmt: skip


@module_loop
@pytest.mark.parametrize(("fields", "param"), PREFILL_REFUSED, ids=lambda v: str(v)[:40])
async def test_prefill_fields_that_cannot_be_honoured_are_400s_naming_them(live, fields, param):
    body = {"model": "test-model", "messages": PREFILL, "max_tokens": 2} | fields
    r = await live.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
    assert (await live.http.get("/health")).status_code == 200


# ---------------------------------------------------------------- finish_reason abort


async def _until_running(live: Live, n: int = 1) -> None:
    while live.engine.snapshot().running < n:
        await asyncio.sleep(0.01)


@module_loop
async def test_an_aborted_request_finishes_with_abort_streamed_and_whole(slow):
    headers = {"X-Request-Id": "stream-1"}
    stream = await slow.client.completions.create(
        model="test-model", prompt="hello", max_tokens=400, stream=True,
        extra_headers=headers, extra_body=NO_EOS,
    )  # fmt: skip
    reasons = []
    async for chunk in stream:
        if not reasons:
            aborted = await slow.http.post("/abort_requests", json={"request_ids": ["stream-1"]})
            assert aborted.json() == {"aborted": 1}
        reasons += [c.finish_reason for c in chunk.choices]
    assert reasons[-1] == "abort" and reasons[:-1] == [None] * (len(reasons) - 1)
    whole = asyncio.ensure_future(
        slow.client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=400,
            extra_headers={"X-Request-Id": "whole-1"}, extra_body=NO_EOS,
        )
    )  # fmt: skip
    await asyncio.wait_for(_until_running(slow), 30)
    aborted = await slow.http.post("/abort_requests", json={"request_ids": ["whole-1"]})
    assert aborted.json() == {"aborted": 1}
    reply = await whole
    assert reply.choices[0].finish_reason == "abort"
    assert reply.usage is not None and reply.usage.completion_tokens < 400


# ---------------------------------------------------------------- the log


def _formatted(logger: str, message: str = "hello") -> str:
    handlers = logging.getLogger(logger).handlers
    assert handlers, logger
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, message, (), None)
    return handlers[0].format(record)


def test_every_log_line_starts_with_its_time(llama):
    config = engine_config(llama)
    uvicorn_config(create_app(config), config)  # uvicorn configures its loggers here
    configure_logging(config.server)
    for logger in ("uvicorn", "uvicorn.error", "stallfree"):
        line = _formatted("uvicorn" if logger == "uvicorn.error" else logger)
        assert TIMESTAMP.match(line) and line.endswith("hello"), line
    access = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "GET", "/v1/models", "1.1", 200), None,
    )  # fmt: skip
    line = logging.getLogger("uvicorn.access").handlers[0].format(access)
    assert TIMESTAMP.match(line) and "/v1/models" in line, line


@pytest.mark.slow
def test_every_line_a_served_process_logs_starts_with_its_time():
    import httpx

    with stallfree_serve() as (proc, base):
        assert httpx.get(base + "/v1/models").status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read() if proc.stdout else ""
    lines = [line for line in out.splitlines() if line.strip()]
    assert any("/v1/models" in line for line in lines), out
    untimed = [line for line in lines if not TIMESTAMP.match(line)]
    assert not untimed, untimed


# ---------------------------------------------------------------- tools a template ignores


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS_TEMPLATE = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


async def _warnings_of_a_chat_with_tools(
    llama: str, template: str | None, parser: str | None = None
) -> list[str]:
    with warnings_logged() as records:
        server = {} if template is None else {"chat_template": template}
        if parser is not None:
            server["tool_call_parser"] = parser
        async with serving(llama, server=server) as live:
            await live.client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}],
                tools=[TOOL], tool_choice="required", max_tokens=30,  # type: ignore[list-item]
                extra_headers={"X-Request-Id": "tools-1"},
            )  # fmt: skip
            await live.client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    return [r.getMessage() for r in records if r.name.startswith("stallfree")]


async def test_tools_a_template_ignores_are_warned_of_at_start_up_and_per_request(llama):
    # the model's template has no tools; with a tool-call parser set, tools are meant for it
    messages = await _warnings_of_a_chat_with_tools(llama, None, parser="hermes")
    start_up = [m for m in messages if m.startswith("this model's chat template")]
    per_request = [m for m in messages if m.startswith("request tools-1:")]
    assert len(start_up) == 1 and "does not use `tools`" in start_up[0], messages
    assert len(per_request) == 1 and "1 tools are not in the prompt" in per_request[0]
    assert len(messages) == 2, messages  # the chat without tools says nothing
    # no parser: the start-up line is a note, the request still a warning
    messages = await _warnings_of_a_chat_with_tools(llama, None)
    assert [m.split(":")[0] for m in messages] == ["request tools-1"], messages
    assert await _warnings_of_a_chat_with_tools(llama, TOOLS_TEMPLATE, parser="hermes") == []


def test_the_prefill_check_refuses_both_fields_true():
    from stallfree.entrypoints.server.base.errors import ApiError
    from stallfree.entrypoints.server.intake.screening import check_prefill

    check_prefill(None, True)
    check_prefill(False, True)
    check_prefill(None, False)
    check_prefill(True, False)
    check_prefill(False, False)  # the chat rendered without the assistant's header
    with pytest.raises(ApiError):
        check_prefill(True, True)
