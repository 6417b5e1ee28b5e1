"""`Engine`: the embedding API. `async with Engine(config) as engine: async for chunk in ...`.

The engine validates and admits requests and streams their chunks. The components it drives are
built, whole, by `build_core`; output processing lives in `OutputProcessor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import torch

from stallfree.config import StallfreeConfig, load_config
from stallfree.overlap.stream import StreamError
from stallfree.runtime.core import EngineCore, build_core, describe_engine
from stallfree.runtime.embed_requests import EmbedRequests, build_embed_requests
from stallfree.runtime.handoff import KVExport, KVImport
from stallfree.runtime.lora.checkpoint import AdapterNotFoundError
from stallfree.runtime.lora.registry import Lease, LoraRegistry
from stallfree.runtime.lora.setup import build_lora
from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.plugins import load_metrics_plugin
from stallfree.runtime.pooled import Pooled
from stallfree.runtime.request.errors import (
    EngineClosedError,
    EngineOverloadedError,
    EngineUnhealthyError,
    InvalidRequestError,
)
from stallfree.runtime.request.outputs import GenerationChunk, GenerationResult, TokenLogprobs
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.request.sampling_params import SamplingParams
from stallfree.runtime.request.structured import StructuredOutputs
from stallfree.runtime.request_table import RequestTable
from stallfree.runtime.telemetry.observer import EngineObserver, MetricsExporter
from stallfree.runtime.telemetry.request_log import RequestLogger
from stallfree.runtime.telemetry.stats import EngineSnapshot, PoolUsage
from stallfree.runtime.text.chat_template import ChatTemplateError, check_chat_template
from stallfree.runtime.text.tokenizer import Tokenizer
from stallfree.runtime.text.validation import RequestValidator, show

__all__ = [
    "Engine",
    "EngineClosedError",
    "EngineOverloadedError",
    "EngineUnhealthyError",
    "GenerationChunk",
    "GenerationResult",
    "InvalidRequestError",
    "PoolUsage",
]

logger = logging.getLogger(__name__)

MAX_RID_CHARS = 256


class Engine:
    # which runner serves the model: "generate" here, "pooling" for an embedder (runtime/pooler.py)
    runner = "generate"
    # LoRA adapters by name and their slots (runtime/lora/); None: off (and on the pooling runner)
    lora: LoraRegistry | None = None
    # embeddings of a native decoder family on this engine's scheduler, beside its generation
    # (runtime/embed_requests.py); None: its model cannot pool, for `embed_refusal`'s reason
    embeddings: EmbedRequests | None = None
    embed_refusal = "this engine runs no model that pools"

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
        self.vocab_size: int = self.core.arch.vocab_size
        self.max_waiting_requests: int = self.core.max_waiting_requests
        self.validator = RequestValidator(
            self.tokenizer, self.vocab_size, self.max_context_len, self.core.ctx.allocator.size
        )
        self.metrics: MetricsExporter | None = None
        if self.config.metrics.enabled:
            plugin = load_metrics_plugin("prometheus")
            self.metrics = plugin.build(self.config, self.core.snapshot)
            self.add_observer(self.metrics)
        if self.config.runtime.log_requests:
            self.add_observer(RequestLogger())
        self._state = "new"  # new -> running -> closing -> closed
        self._loop_task: asyncio.Task[None] | None = None
        # the engine's state is owned by the event loop that started it; see _check_caller
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id: int | None = None
        self._rid_counter = itertools.count()
        # every live request by id, and the steps of its life (runtime/request_table.py)
        self.requests = RequestTable(self.core)
        self.lora = self._build_lora()
        self._build_embeddings()

    def _build_lora(self) -> LoraRegistry | None:
        """The LoRA registry with `lora.lora_modules` loaded; a refused one fails the build
        (its stream closed), naming why."""
        try:
            core = self.core
            lora = build_lora(self.config, core.loaded, core.ctx, core.arch, core.dtype)
            if lora is not None:
                for module in self.config.lora.lora_modules:
                    lora.load_now(module.name, module.path, module.base_model_name)
        except BaseException:
            self.core.stream.close()
            raise
        return lora

    def _build_embeddings(self) -> None:
        """Embeddings beside generation, where the model pools (a plain native family in this
        process); otherwise `embed` is a 400 that says why."""
        try:
            self.embeddings = build_embed_requests(
                self.config, self.core, self.requests, self.max_context_len
            )
        except ModelLoadError as exc:
            self.embed_refusal = str(exc)

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
        self._report_chat_template()

    def _report_chat_template(self) -> None:
        """Say at start-up when the model's chat template does not compile. The engine serves
        on: prompts work, and each chat request is refused naming the same reason."""
        source = self.tokenizer.chat_template
        if not source:
            return
        try:
            check_chat_template(source)
        except ChatTemplateError as exc:
            logger.error("chat requests will be refused: the model's %s", exc)

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
            self.requests.abort_all()
        core.loop.stopping = True
        core.loop.notify()
        assert self._loop_task is not None
        try:
            await self._loop_task
        finally:
            try:
                core.stream.synchronize()
            except StreamError as exc:  # the device was lost; close (and join workers) anyway
                logger.warning("shutting down after a device failure: %s", exc)
            core.scheduler.release_deferred(everything=True)
            core.stream.close()
            if core.grammars is not None:
                core.grammars.close()
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

    def _check_admission(self, rid: object) -> None:
        """The refusals before a request is read: closed, unhealthy, a full waiting queue, a
        malformed id."""
        self._check_caller()
        if not self.accepting:
            state = "shut down" if self._state in ("closing", "closed") else "not started"
            raise EngineClosedError(f"engine is not running ({state})")
        if not self.healthy:
            why = self.core.loop.closed_because or "a failure"
            raise EngineUnhealthyError(
                f"engine failed closed after {why}; it takes no new requests"
            )
        limit = self.max_waiting_requests
        if self.core.scheduler.queues.num_waiting >= limit:
            raise EngineOverloadedError(f"waiting queue is full ({limit} requests)")
        if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS):
            raise InvalidRequestError(
                f"rid must be a non-empty string of at most {MAX_RID_CHARS} characters",
                param="rid",
            )

    def _new_req(self, prompt: object, params: object, rid: object) -> Req:
        self._check_admission(rid)
        validator = self.validator
        sampling = validator.params(params)
        ids = validator.prompt_ids(prompt)
        validator.check_prompt(ids)
        sampling = validator.admit_params(ids, sampling)
        rid = rid if isinstance(rid, str) else f"req-{next(self._rid_counter)}"
        if rid in self.requests or (self.embeddings is not None and rid in self.embeddings):
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        return Req(
            rid=rid,
            origin_input_ids=ids,
            sampling_params=sampling,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            max_context_len=self.max_context_len,
        )

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
        timeout: float | None = None,
        *,
        lora_name: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream a completion. Cancelling the consumer aborts the request and frees its memory.

        `timeout` (seconds, default `runtime.request_timeout_s`) is a deadline for the whole
        request; past it the request is aborted (reason `abort`, error "deadline of ...").
        Call it on the event loop the engine was started on; elsewhere it raises RuntimeError.
        `lora_name`: the adapter it runs under (`lora.enable_lora`); None: the base model.
        """
        # aclosing: a consumer that stops early closes the inner generators at once, so the
        # request is aborted and its memory freed now, not when the garbage collector gets to it
        async with contextlib.aclosing(
            self._submit(prompt, params, rid, timeout, wake_per_step=True, lora_name=lora_name)
        ) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | dict[str, Any] | None,
        rid: str | None,
        timeout: float | None,
        wake_per_step: bool,
        lora_name: str | None = None,
    ) -> AsyncGenerator[GenerationChunk, None]:
        timeout = self._timeout(timeout)
        req = self._new_req(prompt, params, rid)
        if (spec := req.sampling_params.structured_outputs) is not None:
            await self._constrain(req, spec)
        lease = await self._lease(req, lora_name)
        try:
            stream = self.requests.submit(req, wake_per_step)
            async with contextlib.aclosing(self.requests.drain(req, stream, timeout)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if lease is not None:
                assert self.lora is not None
                self.lora.release(lease)

    async def _lease(self, req: Req, lora_name: str | None) -> Lease | None:
        """The slot of `req`'s adapter, held until its stream ends (None: the base model)."""
        if lora_name is None:
            return None
        if self.lora is None:
            raise AdapterNotFoundError(lora_name)
        lease = await self.lora.acquire(lora_name)
        if not self.accepting or req.rid in self.requests:
            self.lora.release(lease)  # shut down, or its id taken, while it waited
            if not self.accepting:
                raise EngineClosedError("engine is shutting down")
            raise InvalidRequestError(f"request id {req.rid!r} is already in use", param="rid")
        req.lora_slot, req.lora_id = lease.slot, lease.uid
        return lease

    async def _constrain(self, req: Req, spec: StructuredOutputs) -> None:
        """Compile the request's grammar off the schedule path; it is queued once ready."""
        assert self.core.grammars is not None
        req.grammar = await self.core.grammars.matcher(spec, spec.source)
        if not self.accepting:
            raise EngineClosedError("engine is shutting down")
        if req.rid in self.requests:  # taken while this one compiled
            raise InvalidRequestError(f"request id {req.rid!r} is already in use", param="rid")

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
                f"timeout must be a positive number of seconds, not {show(timeout)}",
                param="timeout",
            )
        return float(timeout)

    async def generate_imported(
        self,
        prompt_ids: Sequence[int],
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        first_token_id: int,
        params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Decode a request whose prompt was prefilled elsewhere (decode-side disaggregation).

        `kv[layer]` is (k, v), each [len(prompt_ids), num_kv_heads, head_dim] with RoPE applied,
        and `first_token_id` is the token the prefill sampled. A refused import leaves nothing
        behind: the request id stays free.
        """
        req = self._new_req(prompt_ids, params, rid)
        core = self.core
        self.validator.check_import(
            len(req.origin_input_ids), kv, first_token_id, core.ctx.kv_cache.shape
        )
        stream = self.requests.submit(
            req, enqueue=lambda r: core.scheduler.add_imported(r, kv, first_token_id)
        )
        async with contextlib.aclosing(self.requests.drain(req, stream)) as chunks:
            async for chunk in chunks:
                yield chunk

    # the name of earlier releases, kept for the applications that call it
    generate_prebuilt = generate_imported

    def open_export(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> KVExport:
        """Prefill side of disaggregation (runtime/handoff.py): one output token, KV held."""
        params = self.validator.params(params).model_copy(update={"max_new_tokens": 1})
        return KVExport(self.requests, self._new_req(prompt_ids, params, rid))

    def open_import(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> KVImport:
        """Decode side of disaggregation (runtime/handoff.py): the prompt's KV arrives later."""
        return KVImport(self.requests, self._new_req(prompt_ids, params, rid))

    async def complete(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
        timeout: float | None = None,
        *,
        lora_name: str | None = None,
    ) -> GenerationResult:
        """Await the whole output (the caller wakes once, when it is done)."""
        texts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprobs] | None = None
        prompt_logprobs: list[TokenLogprobs | None] | None = None
        last: GenerationChunk | None = None
        async with contextlib.aclosing(
            self._submit(prompt, params, rid, timeout, wake_per_step=False, lora_name=lora_name)
        ) as chunks:
            async for chunk in chunks:
                texts.append(chunk.text)
                ids.extend(chunk.token_ids)
                if chunk.logprobs is not None:
                    logprobs = (logprobs or []) + chunk.logprobs
                if chunk.prompt_logprobs is not None:
                    prompt_logprobs = chunk.prompt_logprobs
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
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cached_tokens=last.cached_tokens,
        )

    async def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
        rid: str | None = None,
    ) -> Pooled:
        """One vector per input (strings or token lists), pooled from the model's final hidden
        states as its checkpoint says (default: the last token, normalised); each input is a
        prefill-only request on this engine's scheduler, beside its generation requests.
        `InvalidRequestError` naming the runner where the model cannot pool."""
        self._check_admission(rid)
        embeddings = self.embeddings
        if embeddings is None:
            raise InvalidRequestError(
                f"this server runs the {self.runner} runner and its model cannot pool "
                f"({self.embed_refusal}); serve an embedder with --runner pooling"
            )
        timeout = self._timeout(timeout)
        rid = rid if isinstance(rid, str) else f"embd-{next(self._rid_counter)}"
        return await embeddings.embed(inputs, dimensions, truncate_prompt_tokens, timeout, rid)

    def abort(self, rid: str) -> bool:
        """Abort a request, or every input of an `embed` call, by id; False if it is unknown
        or already finished."""
        self._check_caller()
        if self.embeddings is not None and rid in self.embeddings:
            return self.embeddings.abort(rid)
        return self.requests.abort(rid)

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
                len(self.requests),
                exc_info=exc,
            )
            message = f"scheduler stopped: {exc!r}"
        self.requests.abort_all(FinishReason.ERROR, message)

    # ------------------------------------------------------------------ introspection

    def snapshot(self) -> EngineSnapshot:
        """Every counter, read at once, without waiting for the device."""
        return self.core.snapshot()

    def pool_usage(self) -> PoolUsage:
        return self.core.pool_usage()

    def flush_cache(self) -> bool:
        """Empty the prefix cache, returning its pages to the pool (SGLang's `/flush_cache`).

        Refused (False) while any request is queued or running, or memory is still to be
        released; True when done, or when prefix caching is off (nothing to flush).
        """
        if self._state == "running":
            self._check_caller()
        return self.core.scheduler.flush_cache()

    async def wait_idle(self) -> None:
        """Wait until no request is queued or running and deferred frees are released.

        Raises `EngineUnhealthyError` if that can never happen: the scheduler task is not
        running (never started, shut down, or dead) while work remains.
        """
        scheduler = self.core.scheduler
        while scheduler.queues.has_work() or scheduler.deferred:
            self._raise_if_loop_dead()
            await asyncio.sleep(0.005)

    def _raise_if_loop_dead(self) -> None:
        """Every waiter calls this: a wait on a loop that no longer runs would never end."""
        task = self._loop_task
        if task is not None and not task.done():
            return
        if task is None:
            raise EngineUnhealthyError("the engine was never started; nothing will run")
        exc = None if task.cancelled() else task.exception()
        why = f"died: {exc!r}" if exc is not None else "stopped"
        raise EngineUnhealthyError(f"the scheduler loop {why}; pending work will never finish")
