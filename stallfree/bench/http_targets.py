"""Targets over HTTP: any OpenAI-compatible server (streaming `/v1/completions`, or
`/v1/chat/completions` for the chat backend, or `/v1/embeddings` whole) and SGLang's native
`/generate`, with the server-sent-event reading and error messages they share."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from stallfree.bench.counters import CounterSnapshot, snapshot_prometheus
from stallfree.bench.results import RequestRecord
from stallfree.bench.targets import FAILED_FINISHES, RequestOptions, RequestTimer, TargetError
from stallfree.bench.workloads import BenchRequest

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import httpx


def api_root(base_url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all name the same server."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


class HttpTarget:
    """An OpenAI-compatible server: streaming `/v1/completions`, and `/metrics` if it has one."""

    backend = "openai"
    path = "/v1/completions"

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        import httpx  # here, not at the top: the base install has no httpx

        self.root = api_root(base_url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client_args: dict[str, Any] = {
            "base_url": self.root,
            "headers": headers,
            "timeout": httpx.Timeout(timeout_s, connect=10.0),
            # httpx caps a client at 100 connections by default, which would cap the
            # concurrency being measured.
            "limits": httpx.Limits(max_connections=None, max_keepalive_connections=None),
            "transport": transport,
        }
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        import httpx

        self.client = httpx.AsyncClient(**self._client_args)
        try:
            resp = await self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            await self.stop()
            raise TargetError(f"cannot reach {self.root}: {_describe(exc)}") from None
        if self.model is None:
            self.model = _first_model(resp)
            if self.model is None:
                await self.stop()
                raise TargetError(
                    f"{self.root}/v1/models answered {resp.status_code} with no model; "
                    "name one with --served-model-name"
                )

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def _body(self, req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": min(req.output_len, opts.max_tokens or req.output_len),
            "temperature": opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if opts.ignore_eos:
            body["ignore_eos"] = True  # an extra that vLLM, SGLang and stallfree accept
        return body

    async def send(self, req: BenchRequest, opts: RequestOptions) -> RequestRecord:
        import httpx

        assert self.client is not None
        record = RequestRecord(req.prompt_len, req.output_len, input_tokens=req.prompt_len)
        timer = RequestTimer(record)
        try:
            async with self.client.stream("POST", self.path, json=self._body(req, opts)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    record.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                    return timer.done()
                chunks = await self._read_stream(resp, record, timer)
        except httpx.HTTPError as exc:
            record.error = _describe(exc)
            return timer.done()
        except ValueError as exc:  # a stream that is not the completions protocol
            record.error = f"bad stream: {exc}"
            return timer.done()
        if record.output_tokens == 0:
            record.output_tokens = chunks  # a server that sends no usage: one token per chunk
        record.success = record.error is None and record.finish_reason not in FAILED_FINISHES
        return timer.done()

    async def _read_stream(
        self, resp: httpx.Response, record: RequestRecord, timer: RequestTimer
    ) -> int:
        chunks = 0
        async for event in _sse_events(resp, record):
            for choice in event.get("choices") or []:
                if text := self._text(choice):
                    timer.content()
                    chunks += 1
                    record.generated_text += str(text)
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
            usage = event.get("usage")
            if usage:
                record.input_tokens = int(usage.get("prompt_tokens", record.input_tokens))
                record.output_tokens = int(usage.get("completion_tokens", 0))
        return chunks

    @staticmethod
    def _text(choice: dict[str, Any]) -> Any:
        return choice.get("text")

    async def counters(self) -> CounterSnapshot | None:
        import httpx

        assert self.client is not None
        try:
            resp = await self.client.get("/metrics")
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return snapshot_prometheus(resp.text)

    def describe(self) -> dict[str, Any]:
        return {"kind": "http", "backend": self.backend, "base_url": self.root, "model": self.model}


def chat_text(prompt: str | list[int]) -> str:
    """A chat message for a prompt: text as it is; token ids (random and shared-prefix
    workloads) as one printable ASCII character each, so equal ids give equal text (shared
    prefixes stay shared) and a byte-level model reads one token per id."""
    if isinstance(prompt, str):
        return prompt
    return "".join(chr(32 + t % 95) for t in prompt)


class ChatHttpTarget(HttpTarget):
    """An OpenAI-compatible server driven through streaming `/v1/chat/completions`: one user
    message per request. TTFT is the first chunk whose delta has content; ITL the gaps
    between such chunks."""

    backend = "openai-chat"
    path = "/v1/chat/completions"

    def _body(self, req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": chat_text(req.prompt)}],
            "max_completion_tokens": min(req.output_len, opts.max_tokens or req.output_len),
            "temperature": opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if opts.ignore_eos:
            body["ignore_eos"] = True
        return body

    @staticmethod
    def _text(choice: dict[str, Any]) -> Any:
        delta = choice.get("delta")
        return delta.get("content") if isinstance(delta, dict) else None


class SGLangTarget(HttpTarget):
    """SGLang's native `POST /generate` (stallfree serves it too), streamed: `text` (or
    `input_ids` for token-id prompts) and `sampling_params`; each SSE event carries `text`
    and `meta_info` (`prompt_tokens`, `completion_tokens`, `finish_reason`), and `[DONE]`
    ends the stream. SGLang sends the text so far in each event, stallfree only the new text;
    both count completion tokens in `meta_info`, so a token event is one where that count
    grows (or, without it, where the text grows)."""

    backend = "sglang"
    path = "/generate"

    async def start(self) -> None:
        import httpx

        self.client = httpx.AsyncClient(**self._client_args)
        try:
            resp = await self.client.get("/v1/models")  # the model's name, for the record
        except httpx.HTTPError as exc:
            await self.stop()
            raise TargetError(f"cannot reach {self.root}: {_describe(exc)}") from None
        if self.model is None:
            self.model = _first_model(resp)  # /generate needs none

    def _body(self, req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
        prompt_key = "text" if isinstance(req.prompt, str) else "input_ids"
        return {
            prompt_key: req.prompt,
            "sampling_params": {
                "max_new_tokens": min(req.output_len, opts.max_tokens or req.output_len),
                "temperature": opts.temperature,
                "ignore_eos": opts.ignore_eos,
            },
            "stream": True,
        }

    async def _read_stream(
        self, resp: httpx.Response, record: RequestRecord, timer: RequestTimer
    ) -> int:
        chunks, tokens = 0, 0
        async for event in _sse_events(resp, record):
            meta = event.get("meta_info") or {}
            text = str(event.get("text") or "")
            new_text = _new_text(record.generated_text, text)
            count = meta.get("completion_tokens")
            if count is not None:
                grew = int(count) > tokens
                tokens = max(tokens, int(count))
            else:
                grew = bool(new_text)
            if grew:
                timer.content()
                chunks += 1
            record.generated_text += new_text
            if "prompt_tokens" in meta:
                record.input_tokens = int(meta["prompt_tokens"])
            reason = meta.get("finish_reason")
            if isinstance(reason, dict):  # SGLang: {"type": "length", "length": 8}
                reason = reason.get("type")
            if reason:
                record.finish_reason = str(reason)
        record.output_tokens = tokens
        return chunks


class EmbeddingsHttpTarget(HttpTarget):
    """`POST /v1/embeddings` (vLLM's `openai-embeddings` backend), one prompt a request,
    answered whole: its figures are requests/s, input tokens/s and latency (TTFT is the whole
    answer's time); there are no output tokens."""

    backend = "openai-embeddings"
    path = "/v1/embeddings"

    def _body(self, req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
        return {"model": self.model, "input": req.prompt, "encoding_format": "base64"}

    async def send(self, req: BenchRequest, opts: RequestOptions) -> RequestRecord:
        import httpx

        assert self.client is not None
        record = RequestRecord(req.prompt_len, 0, input_tokens=req.prompt_len)
        timer = RequestTimer(record)
        try:
            resp = await self.client.post(self.path, json=self._body(req, opts))
        except httpx.HTTPError as exc:
            record.error = _describe(exc)
            return timer.done()
        timer.content()
        if resp.status_code != 200:
            record.error = f"HTTP {resp.status_code}: {_error_message(resp.text)}"
            return timer.done()
        try:
            body = resp.json()
            vectors = len(body["data"])
            record.input_tokens = int(body["usage"]["prompt_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            record.error = f"bad answer: {exc!r}"
            return timer.done()
        record.success = vectors == 1
        if not record.success:
            record.error = f"{vectors} embeddings for one input"
        return timer.done()


async def _sse_events(resp: httpx.Response, record: RequestRecord) -> AsyncIterator[dict[str, Any]]:
    """A stream's JSON events up to `data: [DONE]`; an error event goes to `record.error`
    instead."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            record.error = _error_message(json.dumps(event))
            continue
        yield event


def _new_text(so_far: str, text: str) -> str:
    """The part of an event's `text` not seen yet: SGLang's events repeat the text so far."""
    if so_far and len(text) > len(so_far) and text.startswith(so_far):
        return text[len(so_far) :]
    return text


def http_target(
    backend: str | None,
    base_url: str,
    model: str | None = None,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> HttpTarget:
    """The target for `--backend`: openai (also vllm, and the default), openai-chat, sglang or
    openai-embeddings."""
    cls = {
        "openai-chat": ChatHttpTarget,
        "sglang": SGLangTarget,
        "openai-embeddings": EmbeddingsHttpTarget,
    }.get(backend or "", HttpTarget)
    return cls(base_url, model, api_key, transport=transport)


def _first_model(resp: httpx.Response) -> str | None:
    if resp.status_code != 200:
        return None
    try:
        data = resp.json().get("data") or []
    except (ValueError, AttributeError):
        return None
    return str(data[0]["id"]) if data and isinstance(data[0], dict) and "id" in data[0] else None


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:200]
    if isinstance(err, dict):
        return str(err.get("message", err))[:200]
    return str(err)[:200]


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
