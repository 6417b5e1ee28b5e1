"""`PoolingEngine`: the pooling runner, an embedder or a cross-encoder behind the same front
door as `Engine`.

An encoder (`BertModel`, `BertForSequenceClassification`) attends both ways over its whole
input in one pass and keeps no KV cache; a decoder embedder (a native family's hidden states,
`decoder_embedder.py`) needs its KV only within the pass. `open_engine` serves a decoder
embedder through the paged-KV scheduler (`scheduled_pooler.py`, `embed_requests.py`); an
encoder does not go through it. An encoder's requests share the engine's admission rules
instead (the waiting-queue limit, a request deadline, the closed and unhealthy refusals), its
counters and its observers, and run as their own step type: a loop on the engine's event loop
takes the waiting inputs, up to
`scheduler.max_prefill_tokens` tokens a batch, and runs each batch off the event loop (one
batch at a time), so the server keeps answering while a batch runs. The encoder runs a batch
packed, its inputs one after another without padding (`BertEncoder.packed`).

`open_engine(config)` picks the runner: `model.runner`, or from the checkpoint's architecture.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stallfree.config import StallfreeConfig, load_config
from stallfree.config.model_source import resolve_model_source
from stallfree.overlap.omp_pool import release_caller_pool
from stallfree.overlap.stream import resolve_device
from stallfree.runtime.embed_requests import pooling_refusals
from stallfree.runtime.engine import Engine
from stallfree.runtime.model.arch import SUPPORTED_ARCHITECTURES, ModelLoadError
from stallfree.runtime.model.bert import ENCODER_ARCHITECTURES, BertEncoder, load_bert
from stallfree.runtime.model.cross_encoder import (
    CROSS_ENCODER_ARCHITECTURES,
    BertCrossEncoder,
    load_cross_encoder,
)
from stallfree.runtime.model.decoder_embedder import DecoderEmbedder
from stallfree.runtime.model.loader import load_model, load_tokenizer
from stallfree.runtime.model.pooling import (
    Embedder,
    PoolingConfig,
    check_dimensions,
    finish,
    pool,
    read_pooling_config,
    with_override,
)
from stallfree.runtime.plugins import load_metrics_plugin
from stallfree.runtime.pooled import Pooled, PoolingAborted
from stallfree.runtime.request.errors import (
    EngineClosedError,
    EngineOverloadedError,
    EngineUnhealthyError,
    InvalidRequestError,
    check_waiting_room,
)
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.request.sampling_params import SamplingParams
from stallfree.runtime.scheduled_pooler import ScheduledPoolingEngine
from stallfree.runtime.scheduling.sizing import waiting_limit
from stallfree.runtime.telemetry.observer import ObserverFanout
from stallfree.runtime.telemetry.stats import (
    ActivityClock,
    EngineCounters,
    EngineSnapshot,
    PoolUsage,
)
from stallfree.runtime.text.pooling_inputs import MAX_INPUTS, InputReader, PoolingInputs

logger = logging.getLogger(__name__)

RUNNERS = ("generate", "pooling")
# the encoders: embedders and cross-encoders
_ENCODERS = ENCODER_ARCHITECTURES | CROSS_ENCODER_ARCHITECTURES


def architectures(path: str) -> list[str]:
    """`architectures` of a model directory's config.json (empty for a GGUF file, a preset)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return []
    try:
        names = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [str(n) for n in names] if isinstance(names, list) else []


def runner_for(config: StallfreeConfig) -> str:
    """`model.runner`, or `auto` resolved: pooling for an encoder (an embedder or a cross-
    encoder), else generate.
    `pooling` also takes a native decoder family (an embedder such as Qwen3-Embedding)."""
    archs = architectures(config.model.path)
    encoder = any(a in _ENCODERS for a in archs)
    decoder = any(a in SUPPORTED_ARCHITECTURES for a in archs)
    runner = config.model.runner
    if runner == "auto":
        return "pooling" if encoder else "generate"
    if runner == "generate" and encoder:
        raise ModelLoadError(
            f"{', '.join(archs)} is an encoder: it cannot generate; serve it with --runner pooling"
        )
    if runner == "pooling" and not (encoder or decoder):
        shown = ", ".join(archs) or "this model"
        raise ModelLoadError(
            f"the pooling runner serves encoder embedders "
            f"({', '.join(sorted(_ENCODERS))}) and the native decoder families "
            f"in a model directory; {shown} is not one"
        )
    return runner


def open_engine(config: StallfreeConfig) -> Engine:
    """The engine for `config`'s runner: `PoolingEngine` or the generating `Engine`."""
    config = resolve_model_source(config)
    if runner_for(config) != "pooling":
        return Engine(config)
    if any(a in _ENCODERS for a in architectures(config.model.path)):
        return PoolingEngine(config)
    _check_settings(config)  # a decoder embedder: its inputs go through the scheduler
    return ScheduledPoolingEngine(config)


@dataclass(slots=True, eq=False)
class _Pending:
    req: Req  # what the metrics see: every input's ids, one after another
    inputs: PoolingInputs
    dimensions: int | None
    done: asyncio.Future[Pooled]
    taken: int = 0  # inputs already batched
    parts: list[torch.Tensor] = field(default_factory=list)


class PoolingEngine(Engine):
    """The pooling runner. It is an `Engine` to the server (lifecycle, health, tokenizer,
    limits, snapshot), and refuses generation with a 400 that names its runner; `embed` and
    `score` are its requests.

    It builds no paged-KV core: `Engine.__init__` is not called, and what needs one (KV import
    and export, the prefix cache) is not offered."""

    runner = "pooling"

    def __init__(self, config: StallfreeConfig | None = None, **overrides: Any) -> None:
        if config is not None and overrides:
            raise TypeError("pass either a config or section overrides, not both")
        self.config = resolve_model_source(
            config if config is not None else load_config(**overrides)
        )
        _check_settings(self.config)
        path = Path(self.config.model.path)
        model_config = _read_model_config(path)
        self.device = resolve_device(self.config.runtime.device)
        self.model, self.dtype = self._load(path, model_config)
        # "embed" (/v1/embeddings) or, for a cross-encoder, "score" (/v1/score, /v1/rerank)
        self.task = "score" if isinstance(self.model, BertCrossEncoder) else "embed"
        self.pooling = with_override(
            self._pooling(path, model_config), self.config.model.override_pooler_config
        )
        self.tokenizer = load_tokenizer(self.config.model.tokenizer or str(path))
        self.vocab_size = self.model.vocab_size
        limits = [self.model.max_positions]
        if self.pooling.max_seq_length is not None:
            limits.append(self.pooling.max_seq_length)
        if self.config.model.max_context_len is not None:
            limits.append(self.config.model.max_context_len)
        self.max_context_len = min(limits)
        self.inputs = InputReader(self.tokenizer, self.vocab_size, self.max_context_len)
        # An input waiting here costs its token ids and nothing else, so the default limit
        # holds two calls of the most inputs a call may have (MAX_INPUTS, OpenAI's 2,048): a
        # client that batches to OpenAI's limit is never refused for its call's size.
        self.max_waiting_requests = waiting_limit(self.config)
        if self.config.scheduler.max_waiting_requests is None:
            self.max_waiting_requests = max(self.max_waiting_requests, 2 * MAX_INPUTS)
        # the generation engine's counters and events, so /metrics reads the same families:
        # a pooling step counts as a prefill batch, its tokens as prefill tokens
        self.counters = EngineCounters()
        self.observers = ObserverFanout()
        self.activity = ActivityClock()
        self.observers.observers.append(self.activity)
        self.busy_seconds = 0.0
        self._rids = itertools.count()
        self._state = "new"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id: int | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._waiting: list[_Pending] = []
        self._live: dict[str, _Pending] = {}  # every request not yet answered, by id
        self._wake = asyncio.Event()
        self._stopping = False
        self._running = 0  # requests with an input in the batch being run
        self._current: list[_Pending] = []  # those requests, until their outputs are handed out
        self.metrics = None  # last: the exporter reads a snapshot as it is built
        if self.config.metrics.enabled:
            self.metrics = load_metrics_plugin("prometheus").build(self.config, self.snapshot)
            self.observers.observers.append(self.metrics)

    def _load(
        self, path: Path, model_config: dict[str, Any]
    ) -> tuple[Embedder | BertCrossEncoder, torch.dtype]:
        model = self.config.model
        archs = model_config.get("architectures") or []
        if any(a in _ENCODERS for a in archs):
            dtype = torch.float32 if model.dtype == "auto" else getattr(torch, model.dtype)
            if any(a in CROSS_ENCODER_ARCHITECTURES for a in archs):
                scorer = load_cross_encoder(path, model_config, dtype, self.device)
                if scorer.num_labels != 1:
                    raise ModelLoadError(
                        f"the cross-encoder has {scorer.num_labels} labels; /v1/score and "
                        "/v1/rerank serve one-label cross-encoders (a relevance logit)"
                    )
                return scorer, dtype
            return load_bert(path, model_config, dtype, self.device), dtype
        quantization = "none" if model.quantization == "auto" else model.quantization
        loaded = load_model(
            str(path), model.dtype, self.device, model.seed, quantization=quantization
        )
        return DecoderEmbedder(loaded), loaded.dtype

    def _pooling(self, path: Path, model_config: dict[str, Any]) -> PoolingConfig:
        model = self.model
        if isinstance(model, BertCrossEncoder):  # a score: sigmoid of the [CLS] head's logit
            return PoolingConfig("cls", False, 1, False, None)
        encoder = isinstance(model, BertEncoder)
        # without sentence-transformers files: BERT's [CLS] as it comes; a decoder's last
        # token, normalised (vLLM's defaults for the two)
        return read_pooling_config(
            path,
            model_config,
            model.hidden_size,
            default_mode="cls" if encoder else "last",
            default_normalize=not encoder,
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._state == "running":
            self._check_caller()
            return
        if self._state != "new":
            raise RuntimeError("this engine was shut down; build a new one")
        self._loop = asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._wake = asyncio.Event()
        # one thread runs every batch, with its own OpenMP pool; the event loop's thread gives
        # up the pool the model's load made, so the two never share the cores' spin
        # (overlap/omp_pool.py: a second live pool made the generate engine's steps 4x slower)
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="stallfree-pooling", initializer=self._init_thread
        )
        release_caller_pool()
        self._loop_task = asyncio.create_task(self._run(), name="stallfree-pooler")
        self._loop_task.add_done_callback(self._on_loop_exit)
        self._state = "running"
        logger.info(
            "pooling engine started: %s, %s, hidden %d, %s pooling%s, max %d tokens",
            self.config.model.path,
            type(self.model).__name__,
            self.model.hidden_size,
            self.pooling.mode,
            ", normalised" if self.pooling.normalize else "",
            self.max_context_len,
        )

    async def shutdown(self, drain: bool = True) -> None:
        if self._state == "new":
            self._state = "closed"
            return
        if self._state != "running":
            return
        self._check_caller()
        self._state = "closing"
        if not drain:
            self._fail_waiting(EngineClosedError("engine shut down"))
        self._stopping = True
        self._wake.set()
        assert self._loop_task is not None
        # a loop that died has failed its requests and logged why (_on_loop_exit)
        with contextlib.suppress(Exception):
            await self._loop_task
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._state = "closed"

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """If the step loop dies, no request may wait forever: fail what is waiting."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        logger.error("pooling loop died; failing %d requests", len(self._waiting), exc_info=exc)
        failure = EngineUnhealthyError(f"the pooling loop stopped: {exc!r}")
        for pending in self._current:
            if not pending.done.done():
                pending.done.set_exception(failure)
            self._finish(pending, FinishReason.ERROR)
        self._current = []
        self._fail_waiting(failure)

    @property
    def healthy(self) -> bool:
        if self._state != "running" or self._loop is None or self._loop.is_closed():
            return False
        return self._loop_task is not None and not self._loop_task.done()

    def add_observer(self, observer: object) -> None:
        """The pooling runner emits no per-step events (tracing sees its HTTP spans only)."""

    def _new_req(self, prompt: object, params: object, rid: object) -> Req:
        what = "/v1/score and /v1/rerank" if self.task == "score" else "/v1/embeddings"
        raise InvalidRequestError(
            f"this server runs the pooling runner: it serves {what}, not generation"
        )

    def abort(self, rid: str) -> bool:
        """Abort a pooling request by id (its answer raises `PoolingAborted`); False if it is
        unknown or already answered."""
        self._check_caller()
        pending = self._live.get(rid)
        if pending is None or pending.done.done():
            return False
        pending.done.set_exception(PoolingAborted(f"request {rid!r} was aborted"))
        return True

    def flush_cache(self) -> bool:
        return True  # nothing cached

    async def wait_idle(self) -> None:
        while self._waiting or self._running:
            if self._loop_task is None or self._loop_task.done():
                raise EngineUnhealthyError("the pooling loop is not running")
            await asyncio.sleep(0.005)

    def snapshot(self) -> EngineSnapshot:
        busy = self.busy_seconds
        return EngineSnapshot(
            running=self._running,
            waiting=len(self._waiting),
            pools=self.pool_usage(),
            counters=self.counters.copy(),
            stalls={},
            stall_seconds={},
            mirror_reads={},
            device_busy_seconds=busy,
            device_idle_seconds=max(0.0, self.activity.seconds(time.perf_counter()) - busy),
            max_context_len=self.max_context_len,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def pool_usage(self) -> PoolUsage:
        """No request holds a slot or KV: an encoder keeps nothing between its steps."""
        slots = self.config.cache.max_running_requests
        return PoolUsage(
            req_slots_free=slots, req_slots_total=slots, kv_tokens_free=0, kv_tokens_total=0
        )

    # ------------------------------------------------------------------ requests

    def check_dimensions(self, dimensions: int | None) -> None:
        check_dimensions(self.pooling, dimensions)

    async def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
        rid: str | None = None,
    ) -> Pooled:
        """Pool each input into one vector; batched with the other waiting requests. `rid`
        (default: one of the engine's) is what `abort` takes."""
        self._admit()
        if self.task != "embed":
            raise InvalidRequestError(
                "this model is a cross-encoder: it serves /v1/score and /v1/rerank, "
                "not /v1/embeddings"
            )
        self.check_dimensions(dimensions)
        ids = self.inputs.singles(inputs, truncate_prompt_tokens)
        check_waiting_room(self._waiting_inputs(), len(ids.ids), self.max_waiting_requests)
        return await self._enqueue(ids, dimensions, self._timeout(timeout), rid)

    async def score(
        self,
        pairs: Sequence[tuple[str, str]],
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
        rid: str | None = None,
    ) -> Pooled:
        """A cross-encoder's relevance of each (query, document) pair, 0 to 1."""
        self._admit()
        if self.task != "score":
            raise InvalidRequestError(
                "this model is an embedder: it serves /v1/embeddings; /v1/score and "
                f"/v1/rerank need a cross-encoder ({', '.join(CROSS_ENCODER_ARCHITECTURES)})"
            )
        if not pairs:
            raise InvalidRequestError("there are no texts to score", param="input")
        ids = self.inputs.pairs(pairs, truncate_prompt_tokens)
        check_waiting_room(self._waiting_inputs(), len(ids.ids), self.max_waiting_requests)
        return await self._enqueue(ids, None, self._timeout(timeout), rid)

    async def _enqueue(
        self,
        inputs: PoolingInputs,
        dimensions: int | None,
        timeout: float | None,
        rid: str | None,
    ) -> Pooled:
        assert self._loop is not None
        rid = rid or f"pool-{next(self._rids)}"
        if rid in self._live:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        req = Req(
            rid=rid,
            origin_input_ids=[t for row in inputs.ids for t in row],
            sampling_params=SamplingParams(max_new_tokens=1),
            max_context_len=self.max_context_len,
        )
        pending = _Pending(req, inputs, dimensions, self._loop.create_future())
        self._waiting.append(pending)
        self._live[rid] = pending
        self.observers.on_request_added(req)
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(pending.done), timeout)
        finally:
            del self._live[rid]
            if not pending.done.done():  # cancelled or past its deadline
                pending.done.cancel()
            if not req.finished:  # not answered (deadline, cancelled, aborted): drop the rest
                if pending in self._waiting:
                    self._waiting.remove(pending)
                self._finish(pending, FinishReason.ABORT)

    def _admit(self) -> None:
        self._check_caller()
        if not self.accepting:
            state = "shut down" if self._state in ("closing", "closed") else "not started"
            raise EngineClosedError(f"engine is not running ({state})")
        if not self.healthy:
            raise EngineUnhealthyError("the pooling loop stopped; it takes no new requests")
        if self._waiting_inputs() >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"waiting queue is full ({self.max_waiting_requests} requests)"
            )

    def _waiting_inputs(self) -> int:
        """The inputs not yet batched: each one a waiting request, as on the generate engine."""
        return sum(len(p.inputs.ids) - p.taken for p in self._waiting if not p.done.done())

    # ------------------------------------------------------------------ the step loop

    async def _run(self) -> None:
        while True:
            if not self._waiting:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take_batch()
            if not batch:
                continue
            self._current = list({id(p): p for p, _ in batch}.values())
            self._running = len(self._current)
            started = time.perf_counter()
            rows = [pending.inputs.ids[i] for pending, i in batch]
            second = [pending.inputs.second[i] for pending, i in batch]
            try:
                assert self._executor is not None
                outputs = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._forward, rows, second
                )
            except Exception as exc:  # a failed batch fails its requests, not the server
                logger.exception("pooling batch failed")
                self.counters.step_failures += 1
                for pending, _ in batch:
                    if not pending.done.done():
                        pending.done.set_exception(
                            EngineUnhealthyError(f"the pooling step failed: {exc!r}")
                        )
                    self._finish(pending, FinishReason.ERROR)
                self._current = []
                continue
            finally:
                self._running = 0
                self.busy_seconds += time.perf_counter() - started
            self._count_step(rows)
            self._deliver(batch, outputs)
            self._current = []

    def _take_batch(self) -> list[tuple[_Pending, int]]:
        """Inputs in arrival order while their tokens fit `max_prefill_tokens` (at least one
        input); a request may span batches. The BERT models run a batch packed, so its cost
        is its tokens, not its longest input times its size."""
        budget = self.config.scheduler.max_prefill_tokens
        batch: list[tuple[_Pending, int]] = []
        tokens = 0
        while self._waiting:
            pending = self._waiting[0]
            if pending.done.done():  # its caller gave up
                self._waiting.pop(0)
                continue
            ids = pending.inputs.ids[pending.taken]
            if batch and tokens + len(ids) > budget:
                break
            batch.append((pending, pending.taken))
            tokens += len(ids)
            if pending.taken == 0:
                pending.req.first_scheduled_time = time.perf_counter()
                self.counters.prompt_tokens += len(pending.req.origin_input_ids)
                self.observers.on_request_scheduled(pending.req)
            pending.taken += 1
            if pending.taken == len(pending.inputs.ids):
                self._waiting.pop(0)
        return batch

    def _init_thread(self) -> None:
        if self.config.runtime.stream_threads:
            torch.set_num_threads(self.config.runtime.stream_threads)

    @torch.inference_mode()
    def _forward(self, rows: list[list[int]], second: list[int]) -> torch.Tensor:
        model = self.model
        if isinstance(model, BertCrossEncoder):
            return model.logits(rows, second)[:, 0].cpu()
        hidden, mask = model.hidden_states(rows)
        return pool(hidden, mask, self.pooling.mode).float().cpu()

    def _count_step(self, rows: list[list[int]]) -> None:
        tokens = sum(len(ids) for ids in rows)
        self.counters.steps += 1
        self.counters.prefill_batches += 1
        self.counters.prefill_tokens += tokens
        self.observers.on_step(len(rows), decode=False, overlapped=False)
        self.observers.on_step_tokens(tokens)

    def _finish(self, pending: _Pending, reason: FinishReason) -> None:
        """A request's end, counted once, as the generation engine counts its own."""
        req = pending.req
        if req.finished:
            return
        req.finish(reason)
        finished = self.counters.finished
        finished[reason.value] = finished.get(reason.value, 0) + 1
        self.observers.on_request_finished(req, time.perf_counter())

    def _deliver(self, batch: list[tuple[_Pending, int]], outputs: torch.Tensor) -> None:
        for row, (pending, _) in enumerate(batch):
            pending.parts.append(outputs[row])
            if len(pending.parts) == len(pending.inputs.ids) and not pending.done.done():
                stacked = torch.stack(pending.parts)
                result = (
                    torch.sigmoid(stacked.float())
                    if self.task == "score"
                    else finish(stacked, self.pooling, pending.dimensions)
                )
                pending.done.set_result(Pooled(result, pending.inputs.num_tokens))
                self._finish(pending, FinishReason.STOP)

    def _fail_waiting(self, exc: Exception) -> None:
        for pending in self._waiting:
            if not pending.done.done():
                pending.done.set_exception(exc)
            self._finish(pending, FinishReason.ABORT)
        self._waiting.clear()


def _check_settings(config: StallfreeConfig) -> None:
    """What the generating engine offers and the pooling runner does not, refused at start."""
    refused = pooling_refusals(config)
    if refused:
        raise ModelLoadError(f"the pooling runner does not take {', '.join(refused)}")


def _read_model_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path / 'config.json'} is not a JSON object")
    return config
