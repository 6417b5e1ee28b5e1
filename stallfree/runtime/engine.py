"""`Engine`: the embedding API. `async with Engine(config) as engine: async for chunk in ...`."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.config import StallfreeConfig, load_config
from stallfree.hisparse import install_hisparse, resolve_sparse_layers
from stallfree.metrics import EngineMetrics
from stallfree.overlap.faults import FaultInjector
from stallfree.overlap.future_map import FutureMap
from stallfree.overlap.host_read import SyncMonitor
from stallfree.overlap.loop import SchedulerLoop
from stallfree.overlap.stream import make_stream, resolve_device
from stallfree.runtime.alloc import pages_for
from stallfree.runtime.memory_pool import (
    KVCache,
    KVCacheShape,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from stallfree.runtime.model.loader import load_model
from stallfree.runtime.model_runner import ModelRunner
from stallfree.runtime.observer import EngineObserver, ObserverFanout
from stallfree.runtime.req import FinishReason, Req
from stallfree.runtime.sampler import Sampler
from stallfree.runtime.sampling_params import SamplingParams
from stallfree.runtime.schedule_batch import BatchContext, ScheduleBatch
from stallfree.runtime.scheduler import Scheduler
from stallfree.runtime.tokenizer import Detokenizer, find_stop, load_tokenizer


class InvalidRequestError(ValueError):
    """The request itself is wrong (empty, too long, bad token ids); the engine keeps serving."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full, or the engine is shutting down."""


class EngineUnhealthyError(RuntimeError):
    """The engine failed closed after repeated step failures and takes no new work."""


@dataclass(slots=True)
class GenerationChunk:
    rid: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class GenerationResult:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass(slots=True)
class PoolUsage:
    req_slots_free: int
    req_slots_total: int
    kv_tokens_free: int
    kv_tokens_total: int

    @property
    def all_free(self) -> bool:
        return (
            self.req_slots_free == self.req_slots_total
            and self.kv_tokens_free == self.kv_tokens_total
        )


@dataclass(slots=True, eq=False)
class _Stream:
    """Consumer-side state of one request: its queue and detokenizer."""

    queue: asyncio.Queue[GenerationChunk]
    detok: Detokenizer
    stops: list[str]
    # NOTE: only text not yet streamed is kept (bounded by the longest stop string), so the
    # work per token does not grow with the output.
    pending: str = ""
    held_ids: list[int] = field(default_factory=list)
    stop_at: int | None = None  # index into `pending` where a stop string begins


class Engine:
    def __init__(self, config: StallfreeConfig | None = None, **overrides: Any) -> None:
        """`Engine(config)`, or `Engine(model={"path": ...}, runtime={...})` to build one."""
        if config is not None and overrides:
            raise TypeError("pass either a config or section overrides, not both")
        self.config = config if config is not None else load_config(**overrides)
        self._started = False
        self._closing = False
        self._loop_task: asyncio.Task[None] | None = None
        self._rid_counter = itertools.count()
        self._reqs: dict[str, Req] = {}
        self.observers = ObserverFanout()
        self.metrics: EngineMetrics | None = None
        if self.config.metrics.enabled:
            self.metrics = EngineMetrics.for_config(self.config)
            self.add_observer(self.metrics)

    def add_observer(self, observer: EngineObserver) -> None:
        """Register lifecycle hooks (e.g. Prometheus collectors); call before `start`."""
        self.observers.observers.append(observer)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        if self._started:
            return
        cfg = self.config
        self.device = resolve_device(cfg.runtime.device)
        loaded = await asyncio.to_thread(
            load_model, cfg.model.path, cfg.model.dtype, self.device, cfg.model.seed
        )
        self.loaded = loaded
        arch = loaded.arch
        self.tokenizer = load_tokenizer(cfg.model.path, arch.eos_token_ids)
        self.max_context_len = min(
            cfg.model.max_context_len or arch.max_position_embeddings, arch.max_position_embeddings
        )
        sparse_layers = resolve_sparse_layers(cfg.hisparse, arch) if cfg.hisparse.enabled else None
        page_size = cfg.cache.page_size
        total_tokens = cfg.cache.max_total_tokens
        if sparse_layers is not None:
            # NOTE: sparse layers keep every token in the host pool, so the engine can hold more
            # tokens than the device budget; the logical slots follow the host pool.
            total_tokens = math.ceil(total_tokens * cfg.hisparse.host_to_device_ratio)
        num_slots = (pages_for(total_tokens, page_size) + 1) * page_size
        self.stream = make_stream(self.device, cfg.runtime.stream_threads)
        self.monitor = SyncMonitor(self.stream, strict=cfg.runtime.strict)
        self.monitor.stall_sinks.append(self.observers.on_stall)
        self.monitor.mirror_sinks.append(self.observers.on_mirror_read)
        slots = cfg.cache.max_running_requests
        self.ctx = BatchContext(
            req_to_token_pool=ReqToTokenPool(slots, self.max_context_len, self.device),
            allocator=TokenToKVPoolAllocator(num_slots - page_size, page_size),
            kv_cache=KVCache(
                KVCacheShape(arch.num_layers, arch.num_kv_heads, arch.head_dim),
                num_slots,
                loaded.dtype,
                self.device,
            ),
            stream=self.stream,
            monitor=self.monitor,
            future_map=FutureMap(slots, self.device),
            cpu_mirrors=cfg.runtime.cpu_mirrors,
            check_mirrors=cfg.runtime.check_mirrors,
        )
        if sparse_layers is not None:
            install_hisparse(cfg.hisparse, sparse_layers, self.ctx, loaded.model)
        self.scheduler = Scheduler(
            config=cfg.scheduler,
            ctx=self.ctx,
            max_running_requests=slots,
            on_token=self._on_token,
            on_finish=self._on_finish,
            observer=self.observers,
        )
        faults = FaultInjector(cfg.faults) if cfg.faults.enabled else None
        self.runner = ModelRunner(
            loaded.model, self.ctx, Sampler(cfg.model.seed, self.device), faults=faults
        )
        self.loop = SchedulerLoop(
            self.scheduler,
            self.runner,
            overlap=cfg.runtime.overlap,
            observer=self.observers,
            max_consecutive_failures=cfg.runtime.max_consecutive_step_failures,
        )
        self.observers.on_start(self)
        self._loop_task = asyncio.create_task(self.loop.run(), name="stallfree-scheduler")
        self._loop_task.add_done_callback(self._on_loop_exit)
        self._started = True

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting work; finish (or abort) what is in flight; release the stream."""
        if not self._started:
            return
        self._closing = True
        if not drain:
            for req in list(self._reqs.values()):
                self.scheduler.abort(req)
        self.loop.stopping = True
        self.loop.notify()
        assert self._loop_task is not None
        try:
            await self._loop_task
        finally:
            self.stream.synchronize()
            self.scheduler.release_deferred(everything=True)
            self.stream.close()
            self._started = False

    # ------------------------------------------------------------------ requests

    def _validate(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.loaded.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_context_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context limit is {self.max_context_len} "
                "(prompt plus at least one new token)"
            )
        if pages_for(len(ids) + 1, self.config.cache.page_size) > self.ctx.allocator.num_pages:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the KV cache holds {self.ctx.allocator.size}"
            )
        return ids

    def _admit(
        self, prompt: str | Sequence[int], params: SamplingParams | dict | None, rid: str | None
    ) -> Req:
        if not self._started or self._closing:
            raise EngineOverloadedError("engine is not running")
        if not self.healthy:
            raise EngineUnhealthyError(
                "engine failed closed after repeated step failures; it takes no new requests"
            )
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        ids = self._validate(prompt, params)
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise EngineOverloadedError(f"waiting queue is full ({limit} requests)")
        rid = rid or f"req-{next(self._rid_counter)}"
        if rid in self._reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        req = Req(
            rid=rid,
            origin_input_ids=ids,
            sampling_params=params,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            max_context_len=self.max_context_len,
        )
        req.sink = _Stream(
            queue=asyncio.Queue(),
            detok=self.tokenizer.detokenizer(ids),
            stops=list(params.stop),
        )
        self._reqs[rid] = req
        self.observers.on_request_added(req)
        return req

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
        req = self._admit(prompt, params, rid)
        self.scheduler.add_request(req)
        self.loop.notify()
        async for chunk in self._drain(req, timeout):
            yield chunk

    async def _next_chunk(
        self, req: Req, deadline: float | None, timeout: float | None
    ) -> GenerationChunk:
        sink: _Stream = req.sink
        if deadline is None:
            return await sink.queue.get()
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(sink.queue.get(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            if not req.finished:
                self.scheduler.abort(req, FinishReason.ABORT, f"deadline of {timeout}s exceeded")
                self.loop.notify()
            return await sink.queue.get()

    async def _drain(
        self, req: Req, timeout: float | None = None
    ) -> AsyncIterator[GenerationChunk]:
        timeout = timeout if timeout is not None else self.config.runtime.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            while True:
                chunk = await self._next_chunk(req, deadline, timeout)
                yield chunk
                if chunk.finished:
                    return
        finally:
            if not req.finished:
                self.abort(req.rid)
            self._reqs.pop(req.rid, None)

    async def complete(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | dict | None = None,
        rid: str | None = None,
        timeout: float | None = None,
    ) -> GenerationResult:
        """Await the whole output."""
        texts: list[str] = []
        ids: list[int] = []
        last: GenerationChunk | None = None
        async for chunk in self.generate(prompt, params, rid, timeout):
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
        self.scheduler.abort(req)
        self.loop.notify()
        return True

    # ------------------------------------------------------------------ streaming hooks

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """If the scheduler task dies, no consumer may wait forever: fail what is pending."""
        if task.cancelled() or task.exception() is None:
            if not self.loop.failed_closed:
                return
            message = "engine failed closed"
        else:
            message = f"scheduler stopped: {task.exception()!r}"
        for req in list(self._reqs.values()):
            if not req.finished:
                req.finish(FinishReason.ERROR, message)
                self._on_finish(req)

    def _on_token(self, req: Req, tok: int) -> bool:
        sink: _Stream = req.sink
        delta = sink.detok.step([tok])
        sink.held_ids.append(tok)
        self.observers.on_tokens(req, 1, time.perf_counter())
        if not sink.stops:
            self._push(req, delta)
            return False
        # a stop string ending in `delta` starts inside `pending`, which holds back enough text
        sink.pending += delta
        idx = find_stop(sink.pending, sink.stops, len(sink.pending) - len(delta))
        if idx is not None:
            sink.stop_at = idx
            return True
        safe = len(sink.pending) - (max(len(s) for s in sink.stops) - 1)
        if safe > 0:
            self._push(req, sink.pending[:safe])
            sink.pending = sink.pending[safe:]
        return False

    def _push(self, req: Req, text: str, final: bool = False) -> None:
        sink: _Stream = req.sink
        ids, sink.held_ids = sink.held_ids, []
        sink.queue.put_nowait(
            GenerationChunk(
                rid=req.rid,
                token_ids=ids,
                text=text,
                finished=final,
                finish_reason=req.finished_reason.value if final and req.finished_reason else None,
                prompt_tokens=len(req.origin_input_ids),
                completion_tokens=len(req.output_ids),
                error=req.finish_message if final else None,
            )
        )

    def _on_finish(self, req: Req) -> None:
        self.observers.on_request_finished(req, time.perf_counter())
        sink: _Stream | None = req.sink
        if sink is None:
            return
        if sink.stop_at is not None:
            tail = sink.pending[: sink.stop_at]
        else:
            tail = sink.pending + sink.detok.flush()
        sink.pending = ""
        self._push(req, tail, final=True)

    # ------------------------------------------------------------------ introspection

    @property
    def healthy(self) -> bool:
        """False once the engine has failed closed or its scheduler task has died."""
        if not self._started or self.loop.failed_closed:
            return False
        return self._loop_task is not None and not self._loop_task.done()

    def pool_usage(self) -> PoolUsage:
        pool, allocator = self.ctx.req_to_token_pool, self.ctx.allocator
        return PoolUsage(
            req_slots_free=pool.available_size(),
            req_slots_total=pool.size,
            kv_tokens_free=allocator.available_size(),
            kv_tokens_total=allocator.size,
        )

    async def wait_idle(self) -> None:
        """Wait until no request is queued or running and deferred frees are released."""
        while self.scheduler.has_work() or self.scheduler.pending_frees:
            await asyncio.sleep(0.005)

    # ------------------------------------------------------------------ disaggregation

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
        req = self._admit(prompt_ids, params, rid)
        self._import_kv(req, kv)
        batch = ScheduleBatch.init_new([req], self.ctx)
        batch.prepare_for_prebuilt()
        self._stash_first_token(req, first_token_id)
        self.scheduler.add_prebuilt(batch, first_token_id)
        self.loop.notify()
        async for chunk in self._drain(req):
            yield chunk

    def _import_kv(self, req: Req, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.ctx.hisparse is not None:
            self._reqs.pop(req.rid, None)
            raise InvalidRequestError("prebuilt KV import is not supported with hisparse enabled")
        arch = self.loaded.arch
        n = len(req.origin_input_ids)
        want = (n, arch.num_kv_heads, arch.head_dim)
        if len(kv) != arch.num_layers or any(
            tuple(k.shape) != want or tuple(v.shape) != want for k, v in kv
        ):
            raise InvalidRequestError(f"prebuilt KV must be {arch.num_layers} layers of {want}")
        allocator = self.ctx.allocator
        slots = self.ctx.req_to_token_pool.alloc(1)
        pages = allocator.alloc_pages(pages_for(n, allocator.page_size))
        if slots is None or pages is None:
            if slots is not None:
                self.ctx.req_to_token_pool.free(slots[0])
            if pages is not None:
                allocator.free_pages(pages)
            self._reqs.pop(req.rid, None)
            raise EngineOverloadedError("no room to import prebuilt KV")
        req.req_pool_idx, req.kv_pages = slots[0], pages
        req.num_computed_tokens = n
        ps = allocator.page_size
        pos = torch.arange(n)
        locs_cpu = torch.tensor(pages, dtype=torch.int64)[pos // ps] * ps + pos % ps
        stream, cache = self.stream, self.ctx.kv_cache
        locs = stream.upload(locs_cpu)
        layers = [(stream.upload(k.detach().cpu()), stream.upload(v.detach().cpu())) for k, v in kv]
        table = self.ctx.req_to_token_pool.req_to_token
        row = req.req_pool_idx

        def write() -> None:
            table[row, :n] = locs
            for layer, (k, v) in enumerate(layers):
                cache.write(layer, locs, k, v)

        stream.submit(write)

    def _stash_first_token(self, req: Req, token_id: int) -> None:
        stream = self.stream
        slot = stream.upload(torch.tensor([req.req_pool_idx], dtype=torch.int64))
        tok = stream.upload(torch.tensor([token_id], dtype=torch.int64))
        rows = stream.upload(torch.zeros(1, dtype=torch.int64))
        stream.submit(self.ctx.future_map.stash, slot, rows, tok)
