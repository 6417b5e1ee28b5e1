"""`Engine`: the embedding API. `async with Engine(config) as engine: async for chunk in ...`.

The engine validates and admits requests and streams their chunks. The components it drives are
built, whole, by `build_core`; output processing lives in `OutputProcessor`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import numbers
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from stallfree.config import StallfreeConfig, load_config
from stallfree.runtime.alloc import free_req_memory, import_prebuilt_kv
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
from stallfree.runtime.request_log import RequestLogger, describe_engine
from stallfree.runtime.sampling_params import SamplingParams, is_valid_unicode
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

logger = logging.getLogger(__name__)

MAX_RID_CHARS = 256


def _show(value: object) -> str:
    """A short rendering of a client-sent value for an error message (ints may be huge)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<{value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
        self.vocab_size: int = self.core.loaded.arch.vocab_size
        self.max_waiting_requests: int = self.core.max_waiting_requests
        self.metrics: MetricsExporter | None = None
        if self.config.metrics.enabled:
            plugin = load_metrics_plugin("prometheus")
            self.metrics = plugin.build(self.config, self.core.snapshot)
            self.add_observer(self.metrics)
        if self.config.runtime.log_requests:
            self.add_observer(RequestLogger())
        self._state = "new"  # new -> running -> closing -> closed
        self._loop_task: asyncio.Task[None] | None = None
        # NOTE: the engine's state is owned by the event loop that started it; see _check_caller
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id: int | None = None
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
        """Start the scheduler task on the running event loop; the engine belongs to it from now.

        An engine runs once: `start()` after `shutdown()` raises `RuntimeError`.
        """
        if self._state == "running":
            self._check_caller()
            return
        if self._state != "new":
            raise RuntimeError("this engine was shut down; build a new one")
        self._loop = asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._loop_task = asyncio.create_task(self.core.loop.run(), name="stallfree-scheduler")
        self._loop_task.add_done_callback(self._on_loop_exit)
        self._state = "running"
        logger.info("engine started: %s", describe_engine(self.core))

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting work; finish (or abort) what is in flight; release the stream."""
        core = self.core
        if self._state == "new":
            core.stream.close()
            self._state = "closed"
            return
        if self._state != "running":
            return
        self._check_caller()
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
            logger.info("engine shut down")

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine was started on; other threads submit work to it."""
        return self._loop

    @property
    def accepting(self) -> bool:
        """Started and not shutting down."""
        return self._state == "running"

    @property
    def healthy(self) -> bool:
        """False once the engine has failed closed or its scheduler task has died. O(1)."""
        if self._state != "running" or self.core.loop.failed_closed:
            return False
        if self._loop is not None and self._loop.is_closed():
            return False
        return self._loop_task is not None and not self._loop_task.done()

    def _check_caller(self) -> None:
        """Raise unless called on the engine's event loop (or its thread, with no loop running).

        The scheduler wakes a consumer by resolving a future on the engine's loop; a consumer
        on another loop or thread would never be woken, so it is refused here instead.
        """
        loop = self._loop
        if loop is None:
            return
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is loop:
            return
        if current is None and threading.get_ident() == self._thread_id:
            return
        raise RuntimeError(
            "this Engine runs on the event loop that started it and cannot be used from "
            "another event loop or thread; submit work to that loop instead, e.g. with "
            "asyncio.run_coroutine_threadsafe(engine.complete(...), engine.loop)"
        )

    # ------------------------------------------------------------------ validation

    def max_new_tokens_limit(self, prompt_len: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens can get: the context's rest, or
        the KV cache's if that is smaller."""
        kv_tokens = self.core.ctx.allocator.size
        return max(0, min(self.max_context_len, kv_tokens) - prompt_len)

    def check_prompt(
        self,
        ids: Sequence[int],
        max_new_tokens: int | None = None,
        param: str = "prompt",
        params: SamplingParams | None = None,
    ) -> None:
        """Raise `InvalidRequestError` unless `ids` (and `max_new_tokens` more) can be served.

        The one place requests are checked against the model: token ids are integers in the
        vocabulary; the prompt leaves room for a new token in the context; `max_new_tokens`
        more fit in the context (`context_length_exceeded`) and in the KV cache
        (`kv_capacity_exceeded`); and, when `params` is given, `check_params` holds.
        """
        self._check_ids(ids, param)
        limit = self.max_context_len
        n = len(ids)
        if n >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, and the {param} has "
                f"{n} tokens (it must leave room for at least one new token)",
                param=param,
                code="context_length_exceeded",
            )
        kv_tokens = self.core.ctx.allocator.size
        if n + 1 > kv_tokens:
            raise InvalidRequestError(
                f"the {param} has {n} tokens; the KV cache holds {kv_tokens} tokens in all, "
                "so it could never be served",
                param=param,
                code="kv_capacity_exceeded",
            )
        if max_new_tokens is not None:
            self._check_max_new_tokens(n, max_new_tokens, param)
        if params is not None:
            self.check_params(params)

    def _check_max_new_tokens(self, prompt_len: int, max_new_tokens: int, param: str) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise InvalidRequestError("max_tokens must be an integer", param="max_tokens")
        if max_new_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, not {_show(max_new_tokens)}", param="max_tokens"
            )
        limit = self.max_context_len
        if prompt_len + max_new_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens is too large: {_show(max_new_tokens)}. This model's maximum context "
                f"length is {limit} tokens and the {param} has {prompt_len} tokens, so at most "
                f"{limit - prompt_len} new tokens fit",
                param="max_tokens",
                code="context_length_exceeded",
            )
        kv_tokens = self.core.ctx.allocator.size
        if prompt_len + max_new_tokens > kv_tokens:
            raise InvalidRequestError(
                f"max_tokens is too large: {max_new_tokens}. The KV cache holds {kv_tokens} tokens "
                f"in all and the {param} has {prompt_len} tokens, so this request could never "
                f"finish; at most {self.max_new_tokens_limit(prompt_len)} new tokens fit",
                param="max_tokens",
                code="kv_capacity_exceeded",
            )

    def check_params(self, params: SamplingParams) -> None:
        """The sampling bounds that depend on the model: top_k and stop token ids."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise InvalidRequestError(
                f"top_k must be -1 (disabled) or between 1 and the vocabulary size ({vocab}), "
                f"not {_show(params.top_k)}",
                param="top_k",
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids out of range [0, {vocab}): {', '.join(map(_show, bad[:5]))}",
                param="stop_token_ids",
            )

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
            raise InvalidRequestError(
                f"{param} must be a list of token ids, not {type(ids).__name__}", param=param
            )
        if not ids:
            raise InvalidRequestError(f"{param} is empty", param=param)
        if not all(type(t) is int for t in ids):
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise InvalidRequestError(
                        f"{param} token ids must be integers; item {i} is "
                        f"{type(t).__name__} {_show(t)}",
                        param=param,
                    )
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab][:5]
            raise InvalidRequestError(
                f"token ids out of range [0, {vocab}): {', '.join(map(_show, bad))}", param=param
            )

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """Tokenize client text; text the tokenizer cannot take is an `InvalidRequestError`."""
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"{param} must be a string, not {type(text).__name__}", param=param
            )
        if not is_valid_unicode(text):
            raise InvalidRequestError(
                f"{param} is not valid Unicode: it holds a lone surrogate code point",
                param=param,
                code="invalid_unicode",
            )
        try:
            return self.tokenizer.encode(text)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(
                f"{param} could not be tokenized: {exc}", param=param
            ) from exc

    def _prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            return self.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.is_complex():
                raise InvalidRequestError(
                    "a tensor prompt must be one-dimensional and of an integer dtype",
                    param="prompt",
                )
            return [int(t) for t in prompt.tolist()]
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise InvalidRequestError(
                f"prompt must be a string or a sequence of token ids, not {type(prompt).__name__}",
                param="prompt",
            )
        ids = list(prompt)
        if not all(type(t) is int for t in ids):
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise InvalidRequestError(
                        f"prompt token ids must be integers; item {i} is "
                        f"{type(t).__name__} {_show(t)}",
                        param="prompt",
                    )
                ids[i] = int(t)
        return ids

    def _params(self, params: object) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, dict):
            return SamplingParams.model_validate(params)  # a ValidationError names the field
        if isinstance(params, SamplingParams):
            return params
        raise InvalidRequestError(
            f"params must be SamplingParams or a dict, not {type(params).__name__}",
            param="params",
        )

    def _admit_params(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check `params` against the model and cap `max_new_tokens` to what can ever fit.

        Everything the context leaves, or more, reads as "as many as fit" and is capped to the
        context's (or the KV cache's) rest, so the admission arithmetic only sees sizes that can
        happen. A smaller value that the KV cache cannot hold is refused.
        """
        self.check_params(params)
        requested = params.max_new_tokens
        if len(ids) + requested >= self.max_context_len:
            capped = self.max_new_tokens_limit(len(ids))
            return params.model_copy(update={"max_new_tokens": capped})
        self._check_max_new_tokens(len(ids), requested, "prompt")
        return params

    def _new_req(self, prompt: object, params: object, rid: object) -> Req:
        self._check_caller()
        if not self.accepting:
            raise EngineOverloadedError("engine is not running")
        if not self.healthy:
            raise EngineUnhealthyError(
                "engine failed closed after repeated step failures; it takes no new requests"
            )
        limit = self.max_waiting_requests
        if self.core.scheduler.num_waiting >= limit:
            raise EngineOverloadedError(f"waiting queue is full ({limit} requests)")
        if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS):
            raise InvalidRequestError(
                f"rid must be a non-empty string of at most {MAX_RID_CHARS} characters",
                param="rid",
            )
        sampling = self._params(params)
        ids = self._prompt_ids(prompt)
        self.check_prompt(ids)
        sampling = self._admit_params(ids, sampling)
        rid = rid or f"req-{next(self._rid_counter)}"
        if rid in self._reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        return Req(
            rid=rid,
            origin_input_ids=ids,
            sampling_params=sampling,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            max_context_len=self.max_context_len,
        )

    def _register(self, req: Req, wake_per_step: bool = True) -> RequestStream:
        stream = self.core.output.add(req, wake_per_step)
        self._reqs[req.rid] = req
        self.core.observers.on_request_added(req)
        return stream

    def _unregister(self, req: Req) -> None:
        self._reqs.pop(req.rid, None)
        self.core.output.discard(req)

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
        request; past it the request is aborted (reason `abort`, error "deadline of ...").
        Call it on the event loop the engine was started on; elsewhere it raises RuntimeError.
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
        timeout = self._timeout(timeout)
        req = self._new_req(prompt, params, rid)
        stream = self._register(req, wake_per_step)
        try:
            self.core.scheduler.add_request(req)
        except BaseException:
            self._unregister(req)
            raise
        self.core.loop.notify()
        async for chunk in self._drain(req, stream, timeout):
            yield chunk

    def _timeout(self, timeout: float | None) -> float | None:
        if timeout is None:
            return self.config.runtime.request_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise InvalidRequestError(
                f"timeout must be a positive number of seconds, not {_show(timeout)}",
                param="timeout",
            )
        return float(timeout)

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
        and `first_token_id` is the token the prefill sampled. A refused import leaves nothing
        behind: the request id stays free.
        """
        req = self._new_req(prompt_ids, params, rid)
        if (
            isinstance(first_token_id, bool)
            or not isinstance(first_token_id, int)
            or not 0 <= first_token_id < self.vocab_size
        ):
            raise InvalidRequestError(
                f"first_token_id must be a token id in [0, {self.vocab_size}), "
                f"not {_show(first_token_id)}",
                param="first_token_id",
            )
        core = self.core
        import_prebuilt_kv(core.ctx, req, kv, first_token_id)
        try:
            stream = self._register(req)
            batch = ScheduleBatch.init_new([req], core.ctx)
            batch.prepare_for_prebuilt()
            core.scheduler.add_prebuilt(batch, first_token_id)
        except BaseException:
            self._unregister(req)
            if req.finished:
                pass  # its memory is on the deferred-free list already
            else:
                req.finish(FinishReason.ERROR, "prebuilt import failed")
                # NOTE: nothing launched reads these fresh slots: free at once
                free_req_memory(core.ctx.req_to_token_pool, core.ctx.allocator, req)
            raise
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
        """Abort a request by id; False if it is unknown or already finished."""
        self._check_caller()
        return self._abort(rid)

    def _abort(self, rid: str) -> bool:
        req = self._reqs.get(rid)
        if req is None or req.finished:
            return False
        self.core.scheduler.abort(req)
        self.core.loop.notify()
        return True

    async def _drain(
        self, req: Req, stream: RequestStream, timeout: float | None = None
    ) -> AsyncIterator[GenerationChunk]:
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
                self._abort(req.rid)
            self._unregister(req)

    def _expire(self, req: Req, timeout: float) -> None:
        # NOTE: the reason stays `abort` (front ends map it); the message says it was the deadline
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
            exc = task.exception()
            logger.error(
                "scheduler loop died; failing %d requests and reporting unhealthy",
                len(self._reqs),
                exc_info=exc,
            )
            message = f"scheduler stopped: {exc!r}"
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
