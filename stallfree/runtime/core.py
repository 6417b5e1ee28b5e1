"""`build_core`: the one place the engine's components are made and wired together (a feature
with a setup of its own, such as `execution/speculative_setup.py`, is called from here).

Everything is built before the engine serves anything, so no component exists half-made and no
caller needs to ask whether an attribute exists yet.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from stallfree.config import StallfreeConfig
from stallfree.config.model_source import resolve_model_source
from stallfree.overlap.faults import FaultInjector
from stallfree.overlap.future_map import FutureMap
from stallfree.overlap.host_read import SyncMonitor
from stallfree.overlap.process_stream import ProcessStream
from stallfree.overlap.stream import CpuStream, DeviceStream, make_stream, resolve_device
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.executor import Executor, LocalExecutor
from stallfree.runtime.execution.model_runner import ModelRunner
from stallfree.runtime.execution.remote import RemoteExecutor
from stallfree.runtime.execution.sampler import Sampler
from stallfree.runtime.execution.speculative_setup import build_spec_decoder, mark_spec
from stallfree.runtime.execution.worker import worker_spec
from stallfree.runtime.execution.worker_launch import start_workers
from stallfree.runtime.memory.pool import (
    KVCache,
    KVCacheShape,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from stallfree.runtime.memory.radix_cache import RadixCache
from stallfree.runtime.model.arch import ModelArchConfig, ModelLoadError
from stallfree.runtime.model.hf_fallback import TransformersForCausalLM
from stallfree.runtime.model.loader import (
    LoadedModel,
    check_tensor_parallel,
    load_model,
    load_tokenizer,
    model_impl_for,
    read_arch,
    weights_dtype,
)
from stallfree.runtime.plugins import load_sparse_attention_plugin
from stallfree.runtime.scheduling.loop import SchedulerLoop
from stallfree.runtime.scheduling.scheduler import Scheduler
from stallfree.runtime.scheduling.sizing import (
    auto_stream_threads,
    memory_kv_tokens,
    pool_sizes,
    prefix_caching_enabled,
    waiting_limit,
)
from stallfree.runtime.scheduling.spec_policy import SpecPolicy, StepCosts
from stallfree.runtime.telemetry.observer import ObserverFanout
from stallfree.runtime.telemetry.stats import (
    ActivityClock,
    EngineCounters,
    EngineSnapshot,
    PoolUsage,
    SpecStats,
    WorkerRankStats,
)
from stallfree.runtime.text.grammar_compiler import GrammarCompiler, unsupported_reason
from stallfree.runtime.text.output_processor import OutputProcessor
from stallfree.runtime.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class EngineCore:
    config: StallfreeConfig
    loaded: LoadedModel | None  # None when the model lives in worker processes
    arch: ModelArchConfig
    dtype: torch.dtype
    tokenizer: Tokenizer
    max_context_len: int
    stream: DeviceStream
    monitor: SyncMonitor
    ctx: BatchContext
    observers: ObserverFanout
    output: OutputProcessor
    scheduler: Scheduler
    runner: ModelRunner
    loop: SchedulerLoop
    activity: ActivityClock
    max_waiting_requests: int
    worker_stats: torch.Tensor | None = None  # shared host memory the worker ranks write
    grammars: GrammarCompiler | None = None  # structured outputs (text/grammar_compiler.py)
    _idle_reported: float = 0.0

    def _workers(self) -> tuple[WorkerRankStats, ...]:
        stats = self.worker_stats
        if stats is None:
            return ()
        stream = self.stream
        sent = stream.bytes_sent if isinstance(stream, ProcessStream) else 0
        first = self.config.parallel.node_rank * stats.shape[0]
        rows = stats.tolist()  # host memory the workers write, not a device tensor
        return tuple(
            WorkerRankStats(
                rank=first + i,
                steps=int(row[0]),
                step_seconds=row[1],
                comm_seconds=row[2],
                comm_bytes=int(row[3]),
                message_bytes=sent if first + i == 0 else 0,
            )
            for i, row in enumerate(rows)
        )

    def pool_usage(self) -> PoolUsage:
        pool, allocator = self.ctx.req_to_token_pool, self.ctx.allocator
        cache = self.scheduler.cache
        page_size = allocator.page_size
        return PoolUsage(
            req_slots_free=pool.available_size(),
            req_slots_total=pool.size,
            kv_tokens_free=allocator.free_page_count() * page_size,
            kv_tokens_total=allocator.size,
            kv_tokens_cached=cache.cached_pages * page_size if cache is not None else 0,
            kv_tokens_evictable=cache.evictable_pages() * page_size if cache is not None else 0,
        )

    def snapshot(self) -> EngineSnapshot:
        """Read every counter at once; nothing here waits for the device."""
        busy = float(self.stream.busy_seconds)
        # NOTE: CUDA settles busy time when an event is waited on, so wall minus busy can dip;
        # a counter must never go down.
        idle = self.activity.seconds(time.perf_counter()) - busy
        self._idle_reported = max(self._idle_reported, idle)
        sparse = self.ctx.sparse
        monitor = self.monitor
        return EngineSnapshot(
            running=self.scheduler.queues.num_running,
            waiting=self.scheduler.queues.num_waiting,
            pools=self.pool_usage(),
            counters=self.scheduler.stats.copy(),
            stalls=dict(monitor.stall_counts),
            stall_seconds=dict(monitor.stall_seconds),
            mirror_reads=dict(monitor.mirror_reads),
            device_busy_seconds=busy,
            device_idle_seconds=self._idle_reported,
            sparse=sparse.stats() if sparse is not None else None,
            max_context_len=self.max_context_len,
            workers=self._workers(),
            spec=self._spec_stats(),
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def _spec_stats(self) -> SpecStats | None:
        spec = self.config.speculative
        if not spec.enabled:
            return None
        return SpecStats.from_counters(
            spec.method, spec.num_speculative_tokens, self.scheduler.stats
        )


@dataclass(slots=True)
class _Model:
    """What loading gave: the weights (None when the workers hold them), the architecture, the
    dtype, and the device the host-side tables live on."""

    loaded: LoadedModel | None
    arch: ModelArchConfig
    dtype: torch.dtype
    host: torch.device


_FALLBACK_IN_PROCESS = (
    "the transformers fallback (model.model_impl=transformers, or auto for an architecture "
    "with no native family) runs in-process on one rank without HiSparse: use "
    "runtime.worker=inprocess, parallel.tp_size=1 and hisparse.enabled=false"
)


def _load(config: StallfreeConfig, device: torch.device) -> _Model:
    if config.uses_worker_processes:
        if config.runtime.torch_compile:
            raise ValueError("runtime.torch_compile applies to the in-process model only")
        if model_impl_for(config.model.path, config.model.model_impl) == "transformers":
            raise ModelLoadError(_FALLBACK_IN_PROCESS)
        # the workers load the weights; the scheduler only needs the architecture
        check_tensor_parallel(config.model.path, config.parallel.tp_size)
        arch = read_arch(config.model.path)
        dtype = weights_dtype(config.model.path, config.model.dtype, device)
        return _Model(None, arch, dtype, torch.device("cpu"))
    model = config.model
    loaded = load_model(
        model.path,
        model.dtype,
        device,
        model.seed,
        quantization=model.quantization,
        model_impl=model.model_impl,
        trust_remote_code=model.trust_remote_code,
        prepack_prompt_weights=model.prepack_prompt_weights,
        compact_decode_weights=config.compact_weights(),
    )
    if config.hisparse.enabled and isinstance(loaded.model, TransformersForCausalLM):
        raise ModelLoadError(_FALLBACK_IN_PROCESS)
    if config.runtime.torch_compile:
        from stallfree.runtime.model.compile import warm_up

        # the graphs are guarded on torch's thread count: warm up at the stream's
        warm_up(loaded, config.runtime.stream_threads or auto_stream_threads(loaded.arch, 1))
    return _Model(loaded, loaded.arch, loaded.dtype, device)


def _start_stream(
    config: StallfreeConfig,
    arch: ModelArchConfig,
    device: torch.device,
    sizes: tuple[int, int],
) -> tuple[DeviceStream, torch.Tensor | None]:
    """The device stream: this process's (CUDA or CPU-emulated), or the worker processes'
    (which start here, and load the model). Returns it and the workers' shared statistics."""
    process = config.uses_worker_processes
    ranks = config.parallel.tp_size // config.parallel.nnodes if process else 1
    threads = config.runtime.stream_threads or auto_stream_threads(arch, ranks)
    if not process:
        return make_stream(device, threads), None
    max_context_len, num_slots = sizes
    runtime = config.runtime.model_copy(update={"stream_threads": threads})
    spec = worker_spec(config.model_copy(update={"runtime": runtime}), num_slots, max_context_len)
    conn, processes, worker_stats = start_workers(spec)
    assert conn is not None, "node 0 holds the channel to rank 0"
    timeout = config.runtime.step_timeout_s or config.parallel.dist_timeout_s
    return ProcessStream(conn, processes, step_timeout_s=timeout), worker_stats


def _batch_context(
    config: StallfreeConfig,
    model: _Model,
    stream: DeviceStream,
    monitor: SyncMonitor,
    sizes: tuple[int, int],
) -> BatchContext:
    """The pools, the KV cache and the future map, on the device the host tables live on."""
    max_context_len, num_slots = sizes
    process = config.uses_worker_processes
    arch, host, page_size = model.arch, model.host, config.cache.page_size
    slots = config.cache.max_running_requests
    return BatchContext(
        req_to_token_pool=ReqToTokenPool(slots, max_context_len, host),
        allocator=TokenToKVPoolAllocator(num_slots - page_size, page_size),
        kv_cache=KVCache(
            # with workers the KV lives in them; the host keeps the shape, no buffers
            KVCacheShape(0 if process else arch.num_layers, arch.num_kv_heads, arch.head_dim),
            num_slots,
            model.dtype,
            host,
            config.cache.kv_cache_dtype,
        ),
        stream=stream,
        monitor=monitor,
        future_map=FutureMap(slots, host),
        cpu_mirrors=config.runtime.cpu_mirrors,
        check_mirrors=config.runtime.check_mirrors,
        table_journal=[] if process else None,
        import_journal=[] if process else None,
    )


def _scheduler(
    config: StallfreeConfig,
    ctx: BatchContext,
    output: OutputProcessor,
    observers: ObserverFanout,
    prefix_caching: bool,
) -> Scheduler:
    counters = EngineCounters()
    cache = None
    if prefix_caching:
        cache = RadixCache(ctx.allocator, counters)
        ctx.allocator.evictor = cache
    return Scheduler(
        config=config.scheduler,
        ctx=ctx,
        max_running_requests=config.cache.max_running_requests,
        output=output,
        observer=observers,
        stats=counters,
        cache=cache,
        spec=_spec_policy(config, ctx),
    )


def _spec_policy(config: StallfreeConfig, ctx: BatchContext) -> SpecPolicy | None:
    """Speculation's host side; adaptive on a CPU stream also measures what steps cost (the
    stream's worker times each step; a CUDA stream's work is asynchronous to that timing)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    measured = spec.adaptive and spec.cost_aware and isinstance(ctx.stream, CpuStream)
    return SpecPolicy(spec, StepCosts() if measured else None)


def _overlap(config: StallfreeConfig, stream: DeviceStream) -> bool:
    """Whether the loop plans a step while the one before runs. Not with speculative decoding
    in worker processes and legacy reads (`runtime.cpu_mirrors=false`): those read lengths
    from the host's replica of the device state (`ProcessStream`), which learns a verify
    step's lengths from its answer (`RemoteExecutor`), so the next step is planned once it is
    in."""
    if not config.runtime.overlap:
        return False
    legacy = not config.runtime.cpu_mirrors
    if legacy and config.speculative.enabled and isinstance(stream, ProcessStream):
        logger.info(
            "speculative decoding with worker processes and runtime.cpu_mirrors=false plans "
            "each step after the one before (runtime.overlap is off for this engine)"
        )
        return False
    return True


def _runner(
    config: StallfreeConfig, ctx: BatchContext, model: _Model, device: torch.device
) -> ModelRunner:
    """The step planner and its executor: the model in this process, or the workers."""
    faults = FaultInjector(config.faults) if config.faults.enabled else None
    executor: Executor
    if isinstance(ctx.stream, ProcessStream):
        if config.speculative.enabled:  # each worker builds the stream side; the host plans
            mark_spec(config.speculative, ctx)
        executor = RemoteExecutor(ctx, ctx.stream)
    else:
        assert model.loaded is not None
        sampler = Sampler(config.model.seed, device)
        m = config.model
        spec = build_spec_decoder(
            config.speculative, ctx, model.loaded, sampler, (m.dtype, m.quantization, m.seed)
        )
        executor = LocalExecutor(model.loaded.model, ctx, sampler, faults, spec)
    return ModelRunner(ctx, executor, faults)


def build_core(config: StallfreeConfig, observers: ObserverFanout | None = None) -> EngineCore:
    """Load the model and build pools, stream, scheduler, runner and loop for `config`."""
    prefix_caching = prefix_caching_enabled(config)  # a configuration error before any load
    config = resolve_model_source(config)  # Hub ids to local paths
    observers = observers if observers is not None else ObserverFanout()
    activity = ActivityClock()
    observers.observers.append(activity)
    device = resolve_device(config.runtime.device)
    model = _load(config, device)
    arch = model.arch
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.path, arch.eos_token_ids)
    sparse_plugin = None
    capacity_ratio = 1.0
    if config.hisparse.enabled:
        sparse_plugin = load_sparse_attention_plugin("hisparse")
        capacity_ratio = sparse_plugin.capacity_ratio(config.hisparse, arch)
    memory_tokens = memory_kv_tokens(config, arch, model.dtype, device)
    sizes = pool_sizes(config, arch, capacity_ratio, memory_tokens)
    stream, worker_stats = _start_stream(config, arch, device, sizes)
    try:
        return _wire(
            config,
            device,
            observers,
            activity,
            model,
            tokenizer,
            sparse_plugin,
            sizes,
            stream,
            worker_stats,
            prefix_caching,
        )
    except BaseException:
        stream.close()  # e.g. a draft model that fails to load: no worker left behind
        raise


def _wire(
    config: StallfreeConfig,
    device: torch.device,
    observers: ObserverFanout,
    activity: ActivityClock,
    model: _Model,
    tokenizer: Tokenizer,
    sparse_plugin: Any,
    sizes: tuple[int, int],
    stream: DeviceStream,
    worker_stats: torch.Tensor | None,
    prefix_caching: bool,
) -> EngineCore:
    """Everything built on the started stream."""
    arch = model.arch
    monitor = SyncMonitor(stream, strict=config.runtime.strict)
    monitor.stall_sinks.append(observers.on_stall)
    ctx = _batch_context(config, model, stream, monitor, sizes)
    if sparse_plugin is not None:
        assert model.loaded is not None  # the configuration refuses HiSparse with workers
        ctx.sparse = sparse_plugin.install(config.hisparse, arch, ctx, model.loaded.model)
    output = OutputProcessor(tokenizer, observers)
    scheduler = _scheduler(config, ctx, output, observers, prefix_caching)
    runner = _runner(config, ctx, model, device)
    loop = SchedulerLoop(
        scheduler,
        runner,
        overlap=_overlap(config, stream),
        observer=observers,
        max_consecutive_failures=config.runtime.max_consecutive_step_failures,
    )
    output.on_read = loop.notify  # a paused request's reader caught up: schedule it again
    if isinstance(stream, ProcessStream):
        # a lost worker fails the engine closed at once, even while it is idle
        stream.on_fatal = loop.fail_closed_from_thread
    return EngineCore(
        config=config,
        loaded=model.loaded,
        arch=arch,
        dtype=model.dtype,
        tokenizer=tokenizer,
        max_context_len=sizes[0],
        stream=stream,
        monitor=monitor,
        ctx=ctx,
        observers=observers,
        output=output,
        scheduler=scheduler,
        runner=runner,
        loop=loop,
        activity=activity,
        max_waiting_requests=waiting_limit(config),
        worker_stats=worker_stats,
        grammars=_grammar_compiler(config, tokenizer, arch.vocab_size, device, stream),
    )


def _grammar_compiler(
    config: StallfreeConfig,
    tokenizer: Tokenizer,
    vocab_size: int,
    device: torch.device,
    stream: DeviceStream,
) -> GrammarCompiler:
    """Structured outputs' compiler, with the reason this engine cannot run them, if any."""
    in_process = not isinstance(stream, ProcessStream)
    return GrammarCompiler(
        tokenizer,
        vocab_size,
        unsupported_reason(device.type, in_process),
        strict=config.runtime.structured_outputs_strict,
        cache_bytes=config.runtime.grammar_cache_bytes,
    )


def describe_engine(core: EngineCore) -> str:
    """One line naming the model, device, dtype, modes and capacity."""
    cfg = core.config
    dtype = str(core.dtype).removeprefix("torch.")
    allocator = core.ctx.allocator

    def on(flag: bool) -> str:
        return "on" if flag else "off"

    return (
        f"model={cfg.model.path} device={core.stream.device} dtype={dtype} "
        f"overlap={on(cfg.runtime.overlap)} cpu_mirrors={on(cfg.runtime.cpu_mirrors)} "
        f"hisparse={on(cfg.hisparse.enabled)} kv_slots={allocator.size} "
        f"page_size={allocator.page_size} request_slots={core.ctx.req_to_token_pool.size} "
        f"max_context_len={core.max_context_len} max_waiting={core.max_waiting_requests}"
    )
