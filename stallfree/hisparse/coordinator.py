"""`HisparseCoordinator`: host-side bookkeeping for HiSparse, and the device ops it enqueues.

Two halves, never mixed:
- the schedule path (`plan_step`, `map_last_loc_to_buffer`, `request_finished`) decides
  everything from host state and the batch's CPU mirrors, and only *enqueues* device work;
- the forward half (`write_*`, `admit_on_stream`, `select`, `swap_in_selected`) runs on the
  stream, inside the attention backend, and may touch device tensors freely; the copies between
  the host pool and the device buffers are `KVTransfer`'s (`transfer.py`).

All state is keyed by request slot (`req_pool_idx`), so filter and merge need nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stallfree.hisparse.indexer import index_keys, query_proxy, select_topk, uses_selection
from stallfree.hisparse.memory import DeviceBuffers, HostKVPool
from stallfree.hisparse.transfer import KVTransfer
from stallfree.runtime.model.arch import FAMILIES, ModelArchConfig
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.telemetry.stats import SparseStats

if TYPE_CHECKING:
    from stallfree.config import HisparseConfig
    from stallfree.runtime.execution.context import BatchContext
    from stallfree.runtime.request.req import Req

_I64 = torch.int64
_NEVER_EVICT = torch.iinfo(torch.int64).max
STALL_SITE = "hisparse.map_last_loc"


class HisparseConfigError(ValueError):
    """A HiSparse setting that cannot work with this model or the other settings."""


def resolve_sparse_layers(config: HisparseConfig, arch: ModelArchConfig) -> list[int]:
    """The sparse layer ids, validated against the model; raises `HisparseConfigError`."""
    n = arch.num_layers
    layers = list(range(1, n)) if config.sparse_layers is None else list(config.sparse_layers)
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise HisparseConfigError(
            f"hisparse.sparse_layers has {bad}, but the model has {n} layers (valid: 0..{n - 1})"
        )
    if len(set(layers)) != len(layers):
        raise HisparseConfigError(f"hisparse.sparse_layers repeats a layer: {layers}")
    if not layers:
        raise HisparseConfigError(
            f"hisparse.sparse_layers is empty (the model has {n} layer(s); the default makes "
            "every layer but the first sparse)"
        )
    if config.min_sparse_len > config.device_buffer_size:
        raise HisparseConfigError(
            f"hisparse.min_sparse_len ({config.min_sparse_len}) must be <= "
            f"hisparse.device_buffer_size ({config.device_buffer_size}): shorter sequences "
            "attend densely over the device buffer, so they must fit in it"
        )
    if arch.sliding_window is not None:
        raise HisparseConfigError(
            f"hisparse does not support sliding-window attention models ({arch.architecture} "
            f"has sliding_window={arch.sliding_window})"
        )
    if arch.attn_logit_softcapping is not None or arch.query_pre_attn_scalar is not None:
        raise HisparseConfigError(
            f"hisparse does not support {arch.architecture}: its attention scores are "
            "soft-capped or scaled by query_pre_attn_scalar, which sparse attention does not apply"
        )
    family = FAMILIES.get(arch.architecture)
    if family is not None and not family.hisparse:  # what arch.py's FAMILIES says
        raise HisparseConfigError(f"hisparse does not support {arch.architecture}")
    return sorted(layers)


@dataclass(slots=True, eq=False)
class RowState:
    """Host view of one request slot. Counts are of tokens (one host slot = all sparse layers)."""

    host_len: int = 0  # tokens whose KV is in (or enqueued to) the host pool
    buf_len: int = 0  # buffer slots in use; 0 until admitted
    admitted: bool = False
    reserved_pos: int | None = None  # position the reserved slot holds (last decode's token)


@dataclass(slots=True)
class ExtendPlan:
    """Admissions of requests whose prefill completes in this step (device index tensors)."""

    num_admitted: int = 0
    admit_rows: torch.Tensor | None = None  # [A]
    fill_rows: torch.Tensor | None = None  # [F] one entry per token copied into a buffer
    fill_pos: torch.Tensor | None = None
    fill_slots: torch.Tensor | None = None


@dataclass(slots=True)
class DecodePlan:
    """Host decisions for one decode step, consumed by the attention backend on the stream."""

    step: int
    rows: list[int]  # request slot of each row
    n_prev: list[int]  # tokens before the newest, per row
    select: list[bool]  # row attends to a top-k subset
    reserved: torch.Tensor  # [B] device: physical slot the new token's KV is written to
    sel_index: torch.Tensor  # [S] device: batch index of each selecting row
    sel_rows: torch.Tensor  # [S] device: its request slot
    width: int  # most buffer slots any row attends to (before the reserved one)


@dataclass(slots=True)
class HisparseUsage:
    host_slots_used: int
    host_slots_total: int
    buffer_slots_used: int
    buffer_slots_total: int
    rows_tracked: int

    @property
    def all_free(self) -> bool:
        return self.host_slots_used == 0 and self.buffer_slots_used == 0 and not self.rows_tracked


class HisparseCoordinator:
    def __init__(
        self, config: HisparseConfig, sparse_layers: Sequence[int], ctx: BatchContext
    ) -> None:
        self.top_k = config.top_k
        self.buffer_size = config.device_buffer_size
        self.min_sparse_len = config.min_sparse_len
        self.sparse_layers = list(sparse_layers)
        self.layer_index = {layer: i for i, layer in enumerate(self.sparse_layers)}
        self.ctx = ctx
        cache, pool = ctx.kv_cache, ctx.req_to_token_pool
        shape, n = cache.shape, len(self.sparse_layers)
        # HiSparse stores rows as the cache does (quantized ones with their scales)
        self.kv_format = cache.format
        self.host = HostKVPool(
            n, cache.num_slots, shape.num_kv_heads, cache.row_width, cache.dtype, cache.device
        )
        self.buffers = DeviceBuffers(
            n,
            pool.size,
            self.buffer_size,
            pool.max_context_len,
            cache.num_slots,
            shape.num_kv_heads,
            shape.head_dim,
            cache.row_width,
            cache.dtype,
            cache.device,
        )
        self.transfer = KVTransfer(self.host, self.buffers, pool, cache.format)
        # one token, one layer
        self.token_bytes = 2 * shape.num_kv_heads * cache.format.row_bytes(shape.head_dim)
        self._rows: dict[int, RowState] = {}
        self._row_of: dict[Req, int] = {}
        self._step = 0
        self._pending: DecodePlan | None = None
        self._bytes_h2d = 0  # host-known transfers (miss copies are counted on the device)
        self._bytes_d2h = 0
        self._counters = torch.zeros(2, dtype=_I64, device=cache.device)  # hits, misses
        self._counters_cpu = ctx.stream.host_buffer((2,), _I64)
        self._counters_cpu.zero_()

    def release_dense_kv(self) -> None:
        """Drop the device KV cache of sparse layers: their KV lives in the host pool."""
        cache = self.ctx.kv_cache
        for layer in self.sparse_layers:
            cache.k_buffers[layer] = cache.k_buffers[layer].new_empty((0,))
            cache.v_buffers[layer] = cache.v_buffers[layer].new_empty((0,))

    # ------------------------------------------------------------------ schedule path

    def plan_step(
        self,
        mode: ForwardMode,
        reqs: Sequence[Req],
        prefix_lens_cpu: Sequence[int],
        extend_lens_cpu: Sequence[int],
        output_rows: Sequence[bool],
    ) -> ExtendPlan | DecodePlan | None:
        """The per-step plan a launched batch carries in `fb.sparse_plan`."""
        if mode is ForwardMode.DECODE:
            plan, self._pending = self._pending, None
            if plan is None:
                raise RuntimeError("decode batch launched without map_last_loc_to_buffer")
            return plan
        if mode is ForwardMode.EXTEND:
            return self._plan_extend(reqs, prefix_lens_cpu, extend_lens_cpu, output_rows)
        return None

    def _plan_extend(
        self,
        reqs: Sequence[Req],
        prefix_lens_cpu: Sequence[int],
        extend_lens_cpu: Sequence[int],
        output_rows: Sequence[bool],
    ) -> ExtendPlan:
        moved = self.token_bytes * len(self.sparse_layers)
        admit: list[int] = []
        fill: list[tuple[int, int, int]] = []
        for req, prefix, ext, final in zip(
            reqs, prefix_lens_cpu, extend_lens_cpu, output_rows, strict=True
        ):
            row = req.req_pool_idx
            assert row is not None
            state = self._track(req, row)
            state.host_len += ext
            self._bytes_d2h += ext * moved  # the chunk's KV goes to the host pool
            self._bytes_h2d += prefix * moved  # chunked prefill reads its prefix back
            if final:
                admit.append(row)
                fill.extend(self._admit(state, row, prefix + ext))
        if not admit:
            return ExtendPlan()
        self._bytes_h2d += len(fill) * moved
        up = self.ctx.stream.upload
        cols = torch.tensor(fill, dtype=_I64).reshape(-1, 3).T
        return ExtendPlan(
            num_admitted=len(admit),
            admit_rows=up(torch.tensor(admit, dtype=_I64)),
            fill_rows=up(cols[0].contiguous()),
            fill_pos=up(cols[1].contiguous()),
            fill_slots=up(cols[2].contiguous()),
        )

    def _track(self, req: Req, row: int) -> RowState:
        known = self._row_of.get(req)
        if known is not None:
            assert known == row, f"request {req.rid} moved from slot {known} to {row}"
            return self._rows[row]
        if row in self._rows:
            raise RuntimeError(f"request slot {row} still holds HiSparse state of another request")
        self._row_of[req] = row
        state = self._rows[row] = RowState()
        return state

    def _admit(self, state: RowState, row: int, prompt_len: int) -> list[tuple[int, int, int]]:
        """Admission after prefill: the newest `buffer_size` prompt tokens fill the buffer."""
        n = min(prompt_len, self.buffer_size)
        state.buf_len, state.admitted, state.reserved_pos = n, True, None
        return [(row, prompt_len - n + j, j) for j in range(n)]

    def map_last_loc_to_buffer(
        self,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
        req_pool_indices_cpu: torch.Tensor | None,
    ) -> None:
        """Back up the previous token, grow short buffers, map the new token to the reserved slot.

        Decisions come from the CPU mirrors; `None` mirrors (legacy `cpu_mirrors=false`) are read
        from the device through `host_read`, one stall per decode step.
        """
        if seq_lens_cpu is None or req_pool_indices_cpu is None:
            seq_lens_cpu, req_pool_indices_cpu = self._read_device(seq_lens, req_pool_indices)
        self._step += 1
        rows, lens = req_pool_indices_cpu.tolist(), seq_lens_cpu.tolist()
        self._eager_backup_previous_token(rows, lens)
        for row, length in zip(rows, lens, strict=True):
            self._rows[row].reserved_pos = length - 1
        self._pending = self._plan_decode(rows, lens)

    def _read_device(
        self, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = self.ctx.stream
        both = stream.compute(
            lambda a, b: torch.stack([a, b]),
            seq_lens,
            req_pool_indices,
            shape=(2, int(seq_lens.shape[0])),
            dtype=_I64,
        )
        both_cpu = self.ctx.monitor.host_read(both, STALL_SITE)
        return both_cpu[0], both_cpu[1]

    def _eager_backup_previous_token(self, rows: list[int], lens: list[int]) -> None:
        """Enqueue reserved slot -> host slot for each row's previous token, all sparse layers.

        A row whose every earlier token is resident and whose buffer still has room also keeps
        that token in its next buffer slot (buffer growth).
        """
        backup: list[tuple[int, int]] = []
        growth: list[tuple[int, int, int]] = []
        for row, length in zip(rows, lens, strict=True):
            state = self._rows.get(row)
            if state is None or not state.admitted:
                raise RuntimeError(f"request slot {row} decodes before HiSparse admission")
            prev = length - 2
            if state.reserved_pos is None:
                continue  # first decode: the previous token came from prefill, already on host
            if state.reserved_pos != prev:
                raise RuntimeError(f"slot {row}: reserved holds {state.reserved_pos}, not {prev}")
            backup.append((row, prev))
            state.host_len += 1
            if state.buf_len == prev < self.buffer_size:
                growth.append((row, prev, state.buf_len))
                state.buf_len += 1
        if not backup:
            return
        self._bytes_d2h += len(backup) * self.token_bytes * len(self.sparse_layers)
        up = self.ctx.stream.upload
        backup_cpu = torch.tensor(backup, dtype=_I64).T
        growth_cpu = torch.tensor(growth, dtype=_I64).reshape(-1, 3).T
        grow = tuple(up(c.contiguous()) for c in growth_cpu) if growth else None
        backup_rows = up(backup_cpu[0].contiguous())
        backup_pos = up(backup_cpu[1].contiguous())
        # NOTE: enqueued after the step that wrote the reserved slots and before the next step
        # overwrites them. On CUDA this belongs on a side stream that the next forward waits on.
        self.ctx.stream.submit(self.transfer.backup, backup_rows, backup_pos, grow, self._step)

    def _plan_decode(self, rows: list[int], lens: list[int]) -> DecodePlan:
        n_prev = [length - 1 for length in lens]
        select = [uses_selection(n, self.top_k, self.min_sparse_len) for n in n_prev]
        selecting = [i for i, s in enumerate(select) if s]
        width = max(
            (self.top_k if s else n for n, s in zip(n_prev, select, strict=True)), default=0
        )
        up = self.ctx.stream.upload
        rows_cpu = torch.tensor(rows, dtype=_I64)
        return DecodePlan(
            step=self._step,
            rows=rows,
            n_prev=n_prev,
            select=select,
            reserved=up(rows_cpu * self.buffers.stride + self.buffer_size),
            sel_index=up(torch.tensor(selecting, dtype=_I64)),
            sel_rows=up(torch.tensor([rows[i] for i in selecting], dtype=_I64)),
            width=width,
        )

    def request_finished(self, req: Req) -> None:
        """Free the request's buffer slots, host slots and mappings (finish, abort, retract)."""
        row = self._row_of.pop(req, None)
        if row is not None:
            del self._rows[row]

    def request_retracted(self, req: Req) -> None:
        """Drop the request's state as finishing does. The scheduler frees a retracted request's
        slot and pages at once and re-prefills its prompt and outputs from nothing, so none of
        its host or buffer state is kept; that re-prefill admits it afresh (`mask_decoded`
        keeps its outputs attending as their decode steps did)."""
        self.request_finished(req)

    # ------------------------------------------------------------------ stream side

    def write_extend(self, li: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A prefill chunk's KV goes to the host pool; its indexer keys stay on the device."""
        self.transfer.write_extend(li, locs, k, v)

    def host_kv(self, li: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of logical `slots` from the host pool, on the device (chunked prefill's prefix)."""
        return self.transfer.host_kv(li, slots)

    def mask_decoded(
        self,
        li: int,
        row: int,
        prefix: int,
        decode_from: int,
        q: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        """Restrict the prefill mask of output positions to what their decode step attended to.

        A retracted request is re-prefilled with its outputs. Each output token was first run by
        a decode step, which attended to the indexer's top-k earlier tokens (plus itself) when
        `uses_selection`; dense causal attention here would change its hidden state, and so the
        tokens sampled after the re-prefill. `q` [n, H, D] and `mask` [n, seq] are the chunk's,
        whose first position is `prefix`; the chunk's indexer keys must already be written.
        """
        for pos in range(max(prefix, decode_from), prefix + q.shape[0]):
            if not uses_selection(pos, self.top_k, self.min_sparse_len):
                continue
            chosen = self.select(li, row, pos, query_proxy(q[pos - prefix][None])[0])
            mask[pos - prefix, :pos] = False
            mask[pos - prefix, chosen] = True

    def admit_on_stream(self, li: int, plan: ExtendPlan) -> None:
        """Reset admitted rows' maps and copy their newest prompt tokens host -> buffer."""
        if not plan.num_admitted:
            return
        assert plan.fill_rows is not None and plan.fill_pos is not None
        assert plan.fill_slots is not None
        buf = self.buffers
        buf.pos_to_buf[li][plan.admit_rows] = -1
        buf.buf_pos[li][plan.admit_rows] = -1
        buf.last_use[li][plan.admit_rows] = 0
        rows, pos, slots = plan.fill_rows, plan.fill_pos, plan.fill_slots
        self.transfer.load(li, rows, pos, slots)
        buf.pos_to_buf[li][rows, pos] = slots
        buf.buf_pos[li][rows, slots] = pos

    def write_decode(
        self, li: int, plan: DecodePlan, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """The new token's KV lands in the reserved slot; its indexer key at its logical slot."""
        fmt = self.kv_format
        self.buffers.k[li][plan.reserved] = fmt.encode(k)
        self.buffers.v[li][plan.reserved] = fmt.encode(v)
        self.buffers.index_keys[li][locs] = index_keys(k, fmt)

    def select(self, li: int, row: int, n_prev: int, proxy: torch.Tensor) -> torch.Tensor:
        """Top-k positions among the `n_prev` tokens before the newest (ascending)."""
        slots = self.ctx.req_to_token_pool.req_to_token[row, :n_prev]
        return select_topk(proxy, self.buffers.index_keys[li][slots], self.top_k)

    def resident_slots(self, li: int, row: int, n_prev: int) -> torch.Tensor:
        """Buffer slots of positions 0..n_prev-1 of a fully resident row."""
        return self.buffers.pos_to_buf[li][row, :n_prev]

    def swap_in_selected(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: Sequence[int],
        topk: torch.Tensor,
        layer: int,
        step: int,
    ) -> torch.Tensor:
        """Buffer slots [S, K] for the selected positions `topk` [S, K] of a sparse `layer`.

        `seq_lens` are the host-known token counts before the newest. Hits map to their slots;
        misses evict the least recently used unselected slots (per layer) and are copied in
        from the host. Fast path: when every sequence fits in the buffer, all are hits.
        """
        li = self.layer_index[layer]
        buf = self.buffers
        rows = req_pool_indices
        slots = buf.pos_to_buf[li][rows[:, None], topk]
        if all(n <= self.buffer_size for n in seq_lens):
            self._counters[0] += topk.numel()
        else:
            slots = self._load_misses(li, rows, topk, slots)
        buf.last_use[li][rows[:, None], slots] = step
        self._counters_cpu.copy_(self._counters, non_blocking=True)
        return slots

    def _load_misses(
        self, li: int, rows: torch.Tensor, topk: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        buf = self.buffers
        hit = slots >= 0
        miss = ~hit
        key = buf.last_use[li][rows].clone()
        hr, hc = hit.nonzero(as_tuple=True)
        key[hr, slots[hr, hc]] = _NEVER_EVICT  # a slot selected this step is never a victim
        order = torch.argsort(key, dim=1, stable=True)  # least recently used first
        rank = (miss.cumsum(1) - 1).clamp(min=0)
        victims = torch.gather(order, 1, rank)
        mr, mc = miss.nonzero(as_tuple=True)
        v_rows, v_slots, new_pos = rows[mr], victims[mr, mc], topk[mr, mc]
        old_pos = buf.buf_pos[li][v_rows, v_slots]
        had = old_pos >= 0
        buf.pos_to_buf[li][v_rows[had], old_pos[had]] = -1
        buf.pos_to_buf[li][v_rows, new_pos] = v_slots
        buf.buf_pos[li][v_rows, v_slots] = new_pos
        self.transfer.load(li, v_rows, new_pos, v_slots)
        self._counters += torch.stack([hit.sum(), miss.sum()])
        return torch.where(hit, slots, victims)

    # ------------------------------------------------------------------ introspection

    def stats(self, sync: bool = False) -> SparseStats:
        """Cumulative counters. Without `sync` the device counts may lag by a step and nothing
        waits (safe at scrape time); `sync=True` drains the stream first (tests only)."""
        if sync:
            self.ctx.stream.synchronize()
            hits, misses = self._counters.tolist()
        else:
            hits, misses = self._counters_cpu.tolist()
        usage = self.usage()
        return SparseStats(
            hits=int(hits),
            misses=int(misses),
            bytes_h2d=self._bytes_h2d + int(misses) * self.token_bytes,
            bytes_d2h=self._bytes_d2h,
            host_pool_used=usage.host_slots_used,
            host_pool_total=usage.host_slots_total,
            buffer_slots_used=usage.buffer_slots_used,
            buffer_slots_total=usage.buffer_slots_total,
            rows_tracked=usage.rows_tracked,
        )

    def usage(self) -> HisparseUsage:
        states = list(self._rows.values())
        return HisparseUsage(
            host_slots_used=sum(s.host_len for s in states),
            host_slots_total=self.ctx.allocator.size,
            buffer_slots_used=sum(s.buf_len for s in states),
            buffer_slots_total=self.ctx.req_to_token_pool.size * self.buffer_size,
            rows_tracked=len(self._row_of),
        )

    def device_bytes_per_request(self) -> int:
        """Device KV bytes one request slot holds in sparse layers: buffer plus reserved slot."""
        return self.buffers.stride * self.token_bytes * len(self.sparse_layers)
