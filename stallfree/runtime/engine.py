"""`Engine`: the embedding API. `async with Engine(config) as engine: async for chunk in ...`.

The engine validates and admits requests and streams their chunks. The components it drives are
built, whole, by `build_core`; output processing lives in `OutputProcessor`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from stallfree.config import StallfreeConfig, load_config
from stallfree.runtime.alloc import import_prebuilt_kv, pages_for
from stallfree.runtime.core import EngineCore, build_core
from stallfree.runtime.errors import (
    EngineOverloadedError,
    EngineUnhealthyError,
    InvalidRequestError,
)
from stallfree.runtime.observer import EngineObserver, MetricsExporter
from stallfree.runtime.output_processor import GenerationChunk, GenerationResult, RequestStream
from stallfree.runtime.plugins import load_metrics_plugin
from stallfree.runtime.req import FinishReason, Req
from stallfree.runtime.sampling_params import SamplingParams
from stallfree.runtime.schedule_batch import ScheduleBatch
from stallfree.runtime.stats import EngineSnapshot, PoolUsage
from stallfree.runtime.tokenizer import Tokenizer

__all__ = [
    "Engine",
    "EngineOverloadedError",
    "EngineUnhealthyError",
    "GenerationChunk",
    "GenerationResult",
    "InvalidRequestError",
    "PoolUsage",
]


class Engine:
    def __init__(self, config: StallfreeConfig | None = None, **overrides: Any) -> None:
        """`Engine(config)`, or `Engine(model={"path": ...}, runtime={...})` to build one.

        The model is loaded and every component built here; `start()` only starts the loop.
        """
        if config is not None and overrides:
            raise TypeError("pass either a config or section overrides, not both")
        self.config = config if config is not None else load_config(**overrides)
        self.core: EngineCore = build_core(self.config)
        self.tokenizer: Tokenizer = self.core.tokenizer
        self.max_context_len: int = self.core.max_context_len
        self.metrics: MetricsExporter | None = None
        if self.config.metrics.enabled:
            plugin = load_metrics_plugin("prometheus")
            self.metrics = plugin.build(self.config, self.core.snapshot)
            self.add_observer(self.metrics)
        self._state = "new"  # new -> running -> closing -> closed
        self._loop_task: asyncio.Task[None] | None = None
        self._rid_counter = itertools.count()
        self._reqs: dict[str, Req] = {}

    def add_observer(self, observer: EngineObserver) -> None:
        """Subscribe to the engine's events (e.g. a metrics collector)."""
        self.core.observers.observers.append(observer)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        if self._state == "running":
            return
        if self._state != "new":
            raise RuntimeError("this engine was shut down; build a new one")
        self._loop_task = asyncio.create_task(self.core.loop.run(), name="stallfree-scheduler")
        self._loop_task.add_done_callback(self._on_loop_exit)
        self._state = "running"

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting work; finish (or abort) what is in flight; release the stream."""
        core = self.core
        if self._state == "new":
            core.stream.close()
            self._state = "closed"
            return
        if self._state != "running":
            return
        self._state = "closing"
        if not drain:
            for req in list(self._reqs.values()):
                core.scheduler.abort(req)
        core.loop.stopping = True
        core.loop.notify()
        assert self._loop_task is not None
        try:
            await self._loop_task
        finally:
            core.stream.synchronize()
            core.scheduler.release_deferred(everything=True)
            core.stream.close()
            self._state = "closed"

    @property
    def accepting(self) -> bool:
        """Started and not shutting down."""
        return self._state == "running"

    @property
    def healthy(self) -> bool:
        """False once the engine has failed closed or its scheduler task has died."""
        if self._state != "running" or self.core.loop.failed_closed:
            return False
        return self._loop_task is not None and not self._loop_task.done()

    # ------------------------------------------------------------------ validation

    def check_prompt(
        self, ids: Sequence[int], max_new_tokens: int | None = None, param: str = "prompt"
    ) -> None:
        """Raise `InvalidRequestError` unless `ids` (and `max_new_tokens` more) can be served."""
        limit = self.max_context_len
        if not ids:
            raise InvalidRequestError(f"{param} is empty", param=param)
        vocab = self.core.loaded.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token ids out of range [0, {vocab}): {bad[:5]}", param=param
            )
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, and the {param} has "
                f"{len(ids)} tokens (it must leave room for at least one new token)",
                param=param,
                code="context_length_exceeded",
            )
        if max_new_tokens is not None and len(ids) + max_new_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens is too large: {max_new_tokens}. This model's maximum context length "
                f"is {limit} tokens and the {param} has {len(ids)} tokens, so at most "
                f"{limit - len(ids)} new tokens fit",
                param="max_tokens",
                code="context_length_exceeded",
            )
        allocator = self.core.ctx.allocator
        if pages_for(len(ids) + 1, allocator.page_size) > allocator.num_pages:
            raise InvalidRequestError(
                f"{param} has {len(ids)} tokens; the KV cache holds {allocator.size}",
                param=param,
                code="context_length_exceeded",
            )

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self.check_prompt(ids)
        return ids

    def _new_req(
        self, prompt: str | Sequence[int], params: SamplingParams | dict | None, rid: str | None
    ) -> Req:
        if not self.accepting:
            raise EngineOverloadedError("engine is not running")
        if not self.healthy:
            raise EngineUnhealthyError(
                "engine failed closed after repeated step failures; it takes no new requests"
            )
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        ids = self._prompt_ids(prompt)
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and self.core.scheduler.num_waiting >= limit:
            raise EngineOverloadedError(f"waiting queue is full ({limit} requests)")
        rid = rid or f"req-{next(self._rid_counter)}"
        if rid in self._reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        return Req(
            rid=rid,
            origin_input_ids=ids,
            sampling_params=params,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            max_context_len=self.max_context_len,
        )

    def _register(self, req: Req, wake_per_step: bool = True) -> RequestStream:
        self._reqs[req.rid] = req
        stream = self.core.output.add(req, wake_per_step)
        self.core.observers.on_request_added(req)
        return stream

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | dict | None = None,
        rid: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream a completion. Cancelling the consumer aborts the request and frees its memory.

        `timeout` (seconds, default `runtime.request_timeout_s`) is a deadline for the whole
        request; past it the request is aborted and its last chunk says so.
        """
        async for chunk in self._submit(prompt, params, rid, timeout, wake_per_step=True):
            yield chunk

    async def _submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | dict | None,
        rid: str | None,
        timeout: float | None,
        wake_per_step: bool,
    ) -> AsyncIterator[GenerationChunk]:
        req = self._new_req(prompt, params, rid)
        stream = self._register(req, wake_per_step)
        self.core.scheduler.add_request(req)
        self.core.loop.notify()
        async for chunk in self._drain(req, stream, timeout):
            yield chunk

    async def generate_prebuilt(
        self,
        prompt_ids: Sequence[int],
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        first_token_id: int,
        params: SamplingParams | dict | None = None,
        rid: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Decode a request whose prompt was prefilled elsewhere (decode-side disaggregation).

        `kv[layer]` is (k, v), each [len(prompt_ids), num_kv_heads, head_dim] with RoPE applied,
        and `first_token_id` is the token the prefill sampled.
        """
        req = self._new_req(prompt_ids, params, rid)
        core = self.core
        import_prebuilt_kv(core.ctx, req, kv, first_token_id)
        stream = self._register(req)
        batch = ScheduleBatch.init_new([req], core.ctx)
        batch.prepare_for_prebuilt()
        core.scheduler.add_prebuilt(batch, first_token_id)
        core.loop.notify()
        async for chunk in self._drain(req, stream):
            yield chunk

    async def complete(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | dict | None = None,
        rid: str | None = None,
        timeout: float | None = None,
    ) -> GenerationResult:
        """Await the whole output (the caller wakes once, when it is done)."""
        texts: list[str] = []
        ids: list[int] = []
        last: GenerationChunk | None = None
        async for chunk in self._submit(prompt, params, rid, timeout, wake_per_step=False):
            texts.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
        assert last is not None
        return GenerationResult(
            rid=last.rid,
            text="".join(texts),
            token_ids=ids,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            error=last.error,
        )

    def abort(self, rid: str) -> bool:
        req = self._reqs.get(rid)
        if req is None or req.finished:
            return False
        self.core.scheduler.abort(req)
        self.core.loop.notify()
        return True

    async def _drain(
        self, req: Req, stream: RequestStream, timeout: float | None = None
    ) -> AsyncIterator[GenerationChunk]:
        timeout = timeout if timeout is not None else self.config.runtime.request_timeout_s
        # NOTE: one timer per request, not a timed wait per chunk
        deadline = (
            None
            if timeout is None
            else asyncio.get_running_loop().call_later(timeout, self._expire, req, timeout)
        )
        try:
            while True:
                chunk = await stream.next_chunk()
                yield chunk
                if chunk.finished:
                    return
        finally:
            if deadline is not None:
                deadline.cancel()
            if not req.finished:
                self.abort(req.rid)
            self._reqs.pop(req.rid, None)
            self.core.output.discard(req)

    def _expire(self, req: Req, timeout: float) -> None:
        if not req.finished:
            self.core.scheduler.abort(req, FinishReason.ABORT, f"deadline of {timeout}s exceeded")
            self.core.loop.notify()

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """If the scheduler task dies, no consumer may wait forever: fail what is pending."""
        if task.cancelled() or task.exception() is None:
            if not self.core.loop.failed_closed:
                return
            message = "engine failed closed"
        else:
            message = f"scheduler stopped: {task.exception()!r}"
        for req in list(self._reqs.values()):
            if not req.finished:
                self.core.scheduler.abort(req, FinishReason.ERROR, message)

    # ------------------------------------------------------------------ introspection

    def snapshot(self) -> EngineSnapshot:
        """Every counter, read at once, without waiting for the device."""
        return self.core.snapshot()

    def pool_usage(self) -> PoolUsage:
        return self.core.pool_usage()

    async def wait_idle(self) -> None:
        """Wait until no request is queued or running and deferred frees are released."""
        scheduler = self.core.scheduler
        while scheduler.has_work() or scheduler.pending_frees:
            await asyncio.sleep(0.005)
