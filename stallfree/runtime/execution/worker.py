"""Model workers in separate processes: one per tensor-parallel rank.

The scheduler stays in the host process and stays authoritative. For each launched batch it
sends one `StepMessage` (the mode, the per-row host lists, the batch tensors as the host's
replica holds them, the sampling and logits plans, and the `req_to_token` writes made since the
last step) to the rank-0 worker, which broadcasts it to the other ranks over the group. Every
rank runs the same step (`LocalExecutor.run_step`) on its own device state: its KV-head shard of the
cache, its copy of the request table, the future map and the penalty state. Every rank samples
from the same gathered logits with the same generator, so each feeds its own future map the
same token; rank 0 alone returns the sampled tokens (and logprobs, when asked for).

The host side is `ProcessStream` (overlap/process_stream.py) plus `RemoteExecutor`
(execution/remote.py); `worker_launch.py` starts and stops the processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import pickle
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch

from stallfree.config import FaultConfig, SpeculativeConfig, StallfreeConfig
from stallfree.overlap.faults import FaultInjector
from stallfree.overlap.future_map import FutureMap
from stallfree.overlap.host_read import SyncMonitor
from stallfree.overlap.process_stream import (
    WorkerLostError,
    encode_tensor,
)
from stallfree.overlap.stream import make_stream
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.executor import LocalExecutor
from stallfree.runtime.execution.logits import LogprobBuffers
from stallfree.runtime.execution.remote import StepMessage, StepResult, StepUnpickler
from stallfree.runtime.execution.sampler import Sampler
from stallfree.runtime.execution.speculative import SpecDecoder
from stallfree.runtime.execution.speculative_setup import build_spec_decoder
from stallfree.runtime.execution.worker_lengths import DeviceLengths, locate
from stallfree.runtime.memory.pool import (
    KVCache,
    KVCacheShape,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from stallfree.runtime.model.llama import LlamaForCausalLM
from stallfree.runtime.model.loader import LoadedModel
from stallfree.runtime.model.lora import LoraSlots
from stallfree.runtime.model.lora import install as install_lora
from stallfree.runtime.text.grammar_cache import DEFAULT_MAX_BYTES
from stallfree.runtime.text.grammar_compiler import MatcherFactory

logger = logging.getLogger(__name__)

# per local rank, in shared host memory: steps, step seconds, collective seconds, bytes
STAT_FIELDS = ("steps", "step_seconds", "comm_seconds", "comm_bytes")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to build its half of the engine; picklable."""

    model_path: str
    tokenizer_path: str
    dtype: str
    quantization: str
    prepack_prompt_weights: bool
    compact_decode_weights: str  # auto, off, beside, only (StallfreeConfig.compact_weights)
    device: str  # "cpu" or "cuda"
    seed: int
    page_size: int
    num_kv_slots: int
    req_slots: int
    max_context_len: int
    tp_size: int
    nnodes: int
    node_rank: int
    init_method: str
    timeout_s: float
    threads: int
    check_mirrors: bool
    faults: dict[str, Any]
    kv_cache_dtype: str = "auto"
    grammar_cache_bytes: int = DEFAULT_MAX_BYTES
    # speculative decoding's settings (`SpeculativeConfig` dumped); None: off
    speculative: dict[str, Any] | None = None
    # LoRA: (slots, max rank) of every rank's adapter slots (model/lora.py); None: off
    lora: tuple[int, int] | None = None

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def local_ranks(self) -> range:
        per = self.ranks_per_node
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def rank_device(self, rank: int) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", rank % self.ranks_per_node)
        return torch.device("cpu")


def init_method_for(addr: str | None) -> str:
    """`host:port` or `tcp://host:port` as a torch.distributed init method; a free local port
    when `addr` is None (single node)."""
    if addr is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return f"tcp://127.0.0.1:{port}"
    if "://" in addr:
        return addr
    return f"tcp://{addr}"


def worker_spec(config: StallfreeConfig, num_kv_slots: int, max_context_len: int) -> WorkerSpec:
    par = config.parallel
    device = config.runtime.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return WorkerSpec(
        model_path=config.model.path,
        tokenizer_path=config.model.tokenizer or config.model.path,
        dtype=config.model.dtype,
        quantization=config.model.quantization,
        prepack_prompt_weights=config.model.prepack_prompt_weights,
        compact_decode_weights=config.compact_weights(),
        device=device,
        seed=config.model.seed,
        page_size=config.cache.page_size,
        num_kv_slots=num_kv_slots,
        req_slots=config.cache.max_running_requests,
        max_context_len=max_context_len,
        tp_size=par.tp_size,
        nnodes=par.nnodes,
        node_rank=par.node_rank,
        init_method=init_method_for(par.dist_init_addr),
        timeout_s=par.dist_timeout_s,
        threads=config.runtime.stream_threads,
        check_mirrors=config.runtime.check_mirrors,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        faults=config.faults.model_dump(),
        grammar_cache_bytes=config.runtime.grammar_cache_bytes,
        speculative=config.speculative.model_dump() if config.speculative.enabled else None,
        lora=(config.lora.max_loras, config.lora.max_lora_rank)
        if config.lora.enable_lora
        else None,
    )


# ---------------------------------------------------------------------- worker side


def _broadcast_bytes(data: bytes | None, rank: int, group: Any) -> bytes:
    import torch.distributed as dist

    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    n = int(size.item())
    if rank == 0:
        assert data is not None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    if n:
        dist.broadcast(buf, src=0, group=group)
    return data if rank == 0 and data is not None else ctypes.string_at(buf.data_ptr(), n)


def _to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor of a decoded message (dataclasses, tuples, lists, dicts: the logits
    processors' parts are a dict) to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(x, device) for x in obj)
    if isinstance(obj, list):
        return [_to_device(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if not f.name.endswith("_cpu"):
                setattr(obj, f.name, _to_device(getattr(obj, f.name), device))
    return obj


class _Worker:
    def __init__(self, spec: WorkerSpec, rank: int, stats: torch.Tensor) -> None:
        from stallfree.runtime.model.loader import load_model, load_tokenizer

        self.spec, self.rank, self.stats = spec, rank, stats
        self.local = rank - spec.local_ranks().start
        self.device = spec.rank_device(rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.control: Any = None
        self.tp = self._join_group()
        kwargs: dict[str, Any] = {"tp": self.tp} if self.tp is not None else {}
        kwargs["quantization"] = spec.quantization
        kwargs["prepack_prompt_weights"] = spec.prepack_prompt_weights
        kwargs["compact_decode_weights"] = spec.compact_decode_weights
        loaded = load_model(spec.model_path, spec.dtype, self.device, spec.seed, **kwargs)
        arch = loaded.arch
        kv_heads = arch.num_kv_heads
        if self.tp is not None:
            from stallfree.runtime.model.parallel import local_kv_heads

            kv_heads = local_kv_heads(arch, self.tp)
        stream = make_stream(self.device, spec.threads or 1)
        ctx = BatchContext(
            req_to_token_pool=ReqToTokenPool(spec.req_slots, spec.max_context_len, self.device),
            allocator=TokenToKVPoolAllocator(spec.page_size * 2, spec.page_size),
            kv_cache=KVCache(
                KVCacheShape(arch.num_layers, kv_heads, arch.head_dim),
                spec.num_kv_slots,
                loaded.dtype,
                self.device,
                spec.kv_cache_dtype,
            ),
            stream=stream,
            monitor=SyncMonitor(stream),
            future_map=FutureMap(spec.req_slots, self.device),
            check_mirrors=spec.check_mirrors,
        )
        faults = FaultConfig(**spec.faults)
        self.ctx = ctx
        eos = arch.eos_token_ids
        # structured outputs: matchers for the grammars steps bring (built when one first does)
        self.matchers = MatcherFactory(
            lambda: load_tokenizer(spec.tokenizer_path, eos),
            arch.vocab_size,
            spec.grammar_cache_bytes,
        )
        sampler = Sampler(spec.seed, self.device)
        self.executor = LocalExecutor(
            loaded.model,
            ctx,
            sampler,
            faults=FaultInjector(faults) if faults.enabled else None,
            spec=self._spec_decoder(loaded, sampler),
        )
        # speculation: the slots' lengths as this worker's stream leaves them
        self.lengths = (
            DeviceLengths(spec.req_slots, self.device) if spec.speculative is not None else None
        )
        self.lora = self._lora_slots(loaded)

    def _lora_slots(self, loaded: LoadedModel) -> LoraSlots | None:
        """LoRA: this rank's adapter slots, filled by the "lora" imports of step messages."""
        if self.spec.lora is None:
            return None
        assert isinstance(loaded.model, LlamaForCausalLM)  # workers run native families
        return install_lora(loaded.model, *self.spec.lora, loaded.dtype)

    def _spec_decoder(self, loaded: LoadedModel, sampler: Sampler) -> SpecDecoder | None:
        """Speculative decoding's stream side on this rank, built as the in-process engine
        builds it: every rank proposes the same drafts (the n-gram lookup reads the same
        histories; a draft model, whole on each rank, runs the same greedy steps) and verifies
        them on the same gathered logits."""
        spec = self.spec
        if spec.speculative is None:
            return None
        settings = SpeculativeConfig(**spec.speculative)
        model = (spec.dtype, spec.quantization, spec.seed)
        return build_spec_decoder(settings, self.ctx, loaded, sampler, model)

    def _join_group(self) -> Any:
        spec = self.spec
        if spec.tp_size == 1:
            return None
        import torch.distributed as dist

        from stallfree.runtime.model.parallel import TPGroup

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=spec.init_method,
            rank=self.rank,
            world_size=spec.tp_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        self.control = dist.new_group(backend="gloo") if backend != "gloo" else None
        return TPGroup.from_distributed()

    def run_step(self, msg: StepMessage) -> StepResult:
        start = time.perf_counter()
        device = self.device
        if device.type != "cpu":
            msg = _to_device(msg, device)
        args = msg.args
        self._prepare(msg)
        logprobs = args.logprobs
        comm_before = self._comm()
        with torch.inference_mode():
            self.executor.run_step(args)
        lengths = self.lengths.record(args.fb) if self.lengths is not None else None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        comm_after = self._comm()
        row = self.stats[self.local]
        row[0] += 1
        row[1] += elapsed
        row[2] += comm_after[0] - comm_before[0]
        row[3] += comm_after[1] - comm_before[1]
        lp = None
        if logprobs is not None:
            lp = {
                f.name: encode_tensor(getattr(logprobs, f.name))
                for f in dataclasses.fields(logprobs)
                if isinstance(getattr(logprobs, f.name), torch.Tensor)
            }
        part = args.plan.grammar if args.plan is not None else None
        grammar = None if part is None else (part.ended, part.tokens, part.seconds)
        left = None if lengths is None else encode_tensor(lengths.cpu())
        return StepResult(encode_tensor(args.token_ids_cpu), lp, elapsed, grammar, left)

    def _prepare(self, msg: StepMessage) -> None:
        """The step's table writes and imports; its positions, lengths and KV slots where this
        worker holds them (`worker_lengths.py`); the answer's host buffers in the host's
        shapes (a verify step answers each row's tokens, accept count and drafts, and scores
        every position of its rows)."""
        ctx, args = self.ctx, msg.args
        fb = args.fb
        table = ctx.req_to_token_pool.req_to_token
        if self.lengths is not None:
            self.lengths.place(fb)
        for rows, cols, locs in msg.table_writes:
            table[rows, cols] = locs
        self._apply_imports(msg.imports)
        locate(fb, table)
        fb.req_to_token, fb.kv_cache = table, ctx.kv_cache
        host_buffer = ctx.stream.host_buffer
        scored, answer = fb.batch_size, [fb.batch_size]
        if fb.verify is not None:
            scored, answer = sum(fb.extend_lens_cpu), [fb.batch_size, fb.verify.max_k + 3]
        args.token_ids_cpu = host_buffer(tuple(answer), torch.int64)
        if args.plan is not None:
            args.logprobs = LogprobBuffers.allocate(args.plan, scored, host_buffer)

    def _apply_imports(self, imports: list[tuple[Any, ...]]) -> None:
        """Imported KV (this rank's KV-head shard of each layer), first tokens and speculative
        histories."""
        ctx = self.ctx
        cache, fmap = ctx.kv_cache, ctx.future_map
        for op in imports:
            if op[0] == "kv":
                _, layer, slices, ks, vs = op
                k, v = ks[self.rank], vs[self.rank]  # the tensor-parallel rank's shard
                at = 0
                for s in slices:
                    n = s.stop - s.start
                    cache.k_buffers[layer][s].copy_(k[at : at + n])
                    cache.v_buffers[layer][s].copy_(v[at : at + n])
                    at += n
            elif op[0] == "lora":  # an adapter into a slot, whole: the rank cuts its shards
                _, slot, weights = op
                assert self.lora is not None
                self.lora.write(slot, weights)
            elif op[0] == "history":  # speculative decoding: an extend step's tokens
                _, rows, cols, tokens = op
                assert fmap.history is not None
                fmap.history[rows, cols] = tokens
            else:
                _, slots, tokens = op
                fmap.stash(slots, torch.zeros(1, dtype=torch.int64, device=slots.device), tokens)

    def _comm(self) -> tuple[float, float]:
        if self.tp is None:
            return (0.0, 0.0)
        s = self.tp.stats
        return (
            s.all_reduce_seconds + s.all_gather_seconds,
            float(s.all_reduce_bytes + s.all_gather_bytes),
        )


def worker_main(spec: WorkerSpec, rank: int, conn: Connection | None, stats: torch.Tensor) -> None:
    """A worker process: build the rank's half of the engine, then run steps until "stop"."""
    logging.basicConfig(level=logging.WARNING, format=f"[tp{rank}] %(levelname)s %(message)s")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    try:
        worker = _Worker(spec, rank, stats)
    except BaseException as exc:
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(("failed", 0, f"{type(exc).__name__}: {exc}"))
        raise
    if spec.tp_size > 1:
        import torch.distributed as dist

        dist.barrier(group=worker.control)
    if conn is not None:
        conn.send(("ready", 0, {"pid": os.getpid()}))
    try:
        _serve(worker, rank, conn)
    except BaseException:
        if spec.tp_size > 1:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        raise
    # A clean stop leaves without tearing the process group down: the other ranks (the
    # store's host among them) may already be gone, and gloo aborts a process whose teardown
    # finds a peer closed (exit -6, which a worker node reported as its own exit code 250).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(worker: _Worker, rank: int, conn: Connection | None) -> None:
    spec = worker.spec
    while True:
        data: bytes | None = None
        if conn is not None:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                data = pickle.dumps(("stop", 0, None))  # the host is gone: stop every rank
        if spec.tp_size > 1:
            data = _broadcast_bytes(data, rank, worker.control)
        assert data is not None
        kind, seq, body = pickle.loads(data)
        if kind == "stop":
            return
        try:
            result = worker.run_step(StepUnpickler(body, worker.matchers).load())
        except Exception as exc:
            logger.exception("step %d failed on rank %d", seq, rank)
            if conn is None:
                os._exit(1)  # the host sees this rank exit and fails closed
            conn.send(("error", seq, f"rank {rank}: {type(exc).__name__}: {exc}"))
            continue
        if conn is not None:
            conn.send(("ok", seq, result))


__all__ = [
    "STAT_FIELDS",
    "WorkerLostError",
    "WorkerSpec",
    "worker_main",
    "worker_spec",
]
