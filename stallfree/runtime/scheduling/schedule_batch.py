"""`ScheduleBatch`: a batch's device tensors and their CPU mirrors, kept in step by every op.

Device tensors (`req_pool_indices`, `seq_lens`, `out_cache_loc`, `input_ids`) are produced by
uploads or by work enqueued on the stream, always out of place: once a batch is launched its
tensors belong to the stream. The mirrors (`req_pool_indices_cpu`, `seq_lens_cpu`) are what the
schedule path reads. With `cpu_mirrors=false` (legacy) consumers read the device tensors through
`host_read` instead, which stalls until the stream drains.

Every batch operation changes the batch's fields in one place, `_assign`. It takes each group of
fields as a required keyword: the requests, each device tensor together with its mirror, the
per-row host lists and the per-token tensors of one step. An operation either passes a new
value for a group or says `KEEP`; it cannot leave a mirror or a per-row list behind by
forgetting it. `_assign` checks the shapes, and runs the parity checker when
`runtime.check_mirrors` is on. `tests/core/test_mirror_parity.py` checks that no other method
assigns these fields.

Speculative decoding splits the length mirror in two (`docs/overlap.md`): `seq_lens_cpu` is an
upper bound (every draft in flight accepted) and `committed_lens_cpu` is exact as of the last
processed batch. The device's `seq_lens` advance on the stream by the accept lengths, so while
a verify step is in flight parity is `committed <= device <= upper bound`, and exact once it is
processed (`settle_spec`). Without speculation the two host mirrors are equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.planner import StepInput
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode, VerifyLayout
from stallfree.runtime.scheduling.alloc import (
    alloc_for_decode,
    alloc_for_extend,
    alloc_for_verify,
    new_pages_needed,
    write_history,
)
from stallfree.runtime.scheduling.batch_fields import (
    ASSIGNED_FIELDS,
    KEEP,
    Mirrored,
    RowLists,
    StepTensors,
    _empty,
    _Keep,
    retract_order,
)
from stallfree.runtime.scheduling.batch_reads import HostReads
from stallfree.runtime.scheduling.parity import check_launchable, check_parity, check_shapes

if TYPE_CHECKING:
    from stallfree.runtime.request.req import Req

_I64 = torch.int64

__all__ = ["ASSIGNED_FIELDS", "KEEP", "ScheduleBatch", "retract_order"]


@dataclass(slots=True, eq=False)
class ScheduleBatch:
    reqs: list[Req]
    ctx: BatchContext
    forward_mode: ForwardMode = ForwardMode.IDLE
    req_pool_indices: torch.Tensor = field(default_factory=_empty)
    req_pool_indices_cpu: torch.Tensor = field(default_factory=_empty)
    seq_lens: torch.Tensor = field(default_factory=_empty)
    seq_lens_cpu: torch.Tensor = field(default_factory=_empty)
    # exact length as of the last processed batch (speculation: seq_lens_cpu is a bound)
    committed_lens_cpu: torch.Tensor = field(default_factory=_empty)
    out_cache_loc: torch.Tensor = field(default_factory=_empty)
    input_ids: torch.Tensor | None = None  # None in decode: resolved from the future map
    positions: torch.Tensor | None = None
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # rows whose sampled token is real (a final prefill chunk, or any decode row)
    output_rows: list[bool] = field(default_factory=list)
    # output index each row's token will have (seeded sampling)
    output_steps: list[int] = field(default_factory=list)
    # how host code reads the slots and lengths (the mirrors, or legacy device reads)
    reads: HostReads = field(init=False)
    # the layout of the verify step the batch was last prepared for (speculative decoding)
    _verify: VerifyLayout | None = None
    # a mixed step (`mixed`): its last rows are decode rows whose input id the future map holds
    mixed_rows: int = 0

    def __post_init__(self) -> None:
        self.reads = HostReads(self.ctx)

    @classmethod
    def init_new(cls, reqs: list[Req], ctx: BatchContext) -> ScheduleBatch:
        return cls(reqs=list(reqs), ctx=ctx)

    def host_seq_lens(self, site: str) -> torch.Tensor:
        """Sequence lengths on the host: the mirror, or (legacy) a device read at `site`."""
        return self.reads.seq_lens(self.seq_lens_cpu, self.req_pool_indices, self.seq_lens, site)

    def host_req_pool_indices(self, site: str) -> torch.Tensor:
        """Request slots on the host: the mirror, or (legacy) the device's values."""
        return self.reads.req_pool_indices(self.req_pool_indices_cpu, self.req_pool_indices, site)

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ------------------------------------------------------------------ the one place

    def _assign(
        self,
        op: str,
        *,
        reqs: list[Req] | _Keep,
        req_pool_indices: Mirrored | _Keep,
        seq_lens: Mirrored | _Keep,
        committed: torch.Tensor | _Keep,
        rows: RowLists | _Keep,
        step: StepTensors | _Keep,
    ) -> None:
        """Set every per-row and per-step field of an operation `op`, then check them."""
        if reqs is not KEEP:
            self.reqs = reqs
        if req_pool_indices is not KEEP:
            self.req_pool_indices, self.req_pool_indices_cpu = req_pool_indices
        if seq_lens is not KEEP:
            self.seq_lens, self.seq_lens_cpu = seq_lens
        if committed is not KEEP:
            self.committed_lens_cpu = committed
        if rows is not KEEP:
            (
                self.prefix_lens_cpu,
                self.extend_lens_cpu,
                self.output_rows,
                self.output_steps,
            ) = rows
        if step is not KEEP:
            self.out_cache_loc, self.input_ids, self.positions = step
        self._check_shapes(op)
        if self.ctx.check_mirrors:
            self.check_mirror_parity(op)

    def _check_shapes(self, op: str) -> None:
        """Always on (host metadata only): one entry per request in every mirror and list."""
        check_shapes(op, self._mirrors(), self.reqs, self._rows(), self.committed_lens_cpu)

    def _mirrors(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        return [
            ("req_pool_indices", self.req_pool_indices, self.req_pool_indices_cpu),
            ("seq_lens", self.seq_lens, self.seq_lens_cpu),
        ]

    def _rows(self) -> RowLists:
        return RowLists(
            self.prefix_lens_cpu, self.extend_lens_cpu, self.output_rows, self.output_steps
        )

    # ------------------------------------------------------------------ lifecycle

    def prepare_for_extend(self, extend_lens: list[int]) -> None:
        self.forward_mode = ForwardMode.EXTEND
        stream = self.ctx.stream
        prefix_lens = [r.num_computed_tokens for r in self.reqs]
        extend_lens = list(extend_lens)
        ids, pos = [], []
        for req, prefix, ext in zip(self.reqs, prefix_lens, extend_lens, strict=True):
            ids.extend(req.fill_slice(prefix, prefix + ext))
            pos.append(torch.arange(prefix, prefix + ext, dtype=_I64))
        fresh = [r.req_pool_idx is None for r in self.reqs]
        out_cache_loc, rpi, rpi_cpu = alloc_for_extend(self.ctx, self.reqs, extend_lens)
        seq_lens_cpu = torch.tensor(
            [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)], dtype=_I64
        )
        if self.ctx.spec_k:
            write_history(self.ctx, self.reqs, prefix_lens, extend_lens, fresh)
        output_rows, output_steps = [], []
        for req, ext in zip(self.reqs, extend_lens, strict=True):
            req.num_computed_tokens += ext
            final = req.num_computed_tokens == req.fill_len
            output_rows.append(final)
            output_steps.append(req.num_scheduled_outputs)
            if final:
                req.num_scheduled_outputs += 1
        self._assign(
            "prepare_for_extend",
            reqs=KEEP,
            req_pool_indices=Mirrored(rpi, rpi_cpu),
            seq_lens=Mirrored(stream.upload(seq_lens_cpu), seq_lens_cpu),
            committed=seq_lens_cpu.clone(),
            rows=RowLists(prefix_lens, extend_lens, output_rows, output_steps),
            step=StepTensors(
                out_cache_loc,
                stream.upload(torch.tensor(ids, dtype=_I64)),
                stream.upload(torch.cat(pos) if pos else _empty()),
            ),
        )
        # the slots of an extend batch are the host's allocation, as in any baseline
        self.reads.known(rpi, rpi_cpu)

    def prepare_for_decode(self, seq_lens_cpu: torch.Tensor | None = None) -> None:
        """`seq_lens_cpu`: lengths the caller already read for this batch, if any."""
        self.forward_mode = ForwardMode.DECODE
        stream = self.ctx.stream
        if seq_lens_cpu is None:
            seq_lens_cpu = self.host_seq_lens("schedule.page_count")
        n = len(self.reqs)
        out_cache_loc = alloc_for_decode(
            self.ctx, self.reqs, seq_lens_cpu, self.req_pool_indices, self.seq_lens
        )
        rows = RowLists(
            seq_lens_cpu.tolist(),
            [1] * n,
            [True] * n,
            [r.num_scheduled_outputs for r in self.reqs],
        )
        old_seq_lens = self.seq_lens
        self._assign(
            "prepare_for_decode",
            reqs=KEEP,
            req_pool_indices=KEEP,
            # NOTE: out of place: the launched batch still owns the old `seq_lens`.
            seq_lens=Mirrored(
                stream.compute(torch.add, old_seq_lens, 1, shape=(n,), dtype=_I64),
                self.seq_lens_cpu + 1,
            ),
            committed=self.committed_lens_cpu + 1,
            rows=rows,
            # the new token sits at the old length
            step=StepTensors(out_cache_loc, None, old_seq_lens),
        )
        for req in self.reqs:
            req.num_computed_tokens += 1
            req.num_scheduled_outputs += 1
        if self.ctx.sparse is not None:
            self.ctx.sparse.map_last_loc_to_buffer(
                self.seq_lens,
                self.out_cache_loc,
                self.req_pool_indices,
                self.seq_lens_cpu if self.ctx.cpu_mirrors else None,
                self.req_pool_indices_cpu if self.ctx.cpu_mirrors else None,
            )

    @classmethod
    def mixed(cls, ext: ScheduleBatch, running: ScheduleBatch) -> ScheduleBatch:
        """One step of both: the extend batch `ext`, then the decode batch `running` (already
        prepared for this step by `prepare_for_decode`), each decode row an extend row of one
        token whose prefix is its KV so far. The batches keep their own state; this one is
        only launched. The decode rows' input ids are placeholders here: the executor puts in
        the future map's tokens on the stream (`mixed_rows`), as a decode step resolves them."""
        batch = cls.init_new(ext.reqs + running.reqs, ext.ctx)
        batch._prepare_mixed(ext, running)
        return batch

    def _prepare_mixed(self, ext: ScheduleBatch, running: ScheduleBatch) -> None:
        self.forward_mode = ForwardMode.EXTEND
        ctx, stream = self.ctx, self.ctx.stream
        n_dec = len(running.reqs)
        n, n_tok = (len(self.reqs),), (sum(ext.extend_lens_cpu) + n_dec,)
        assert ext.input_ids is not None and ext.positions is not None
        assert running.positions is not None

        def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([a, b])

        rpi = stream.compute(
            cat, ext.req_pool_indices, running.req_pool_indices, shape=n, dtype=_I64
        )
        # the host's allocation (extend) and the slots a decode launch reads anyway
        rpi_cpu = torch.cat(
            [
                ext.host_req_pool_indices("launch.req_pool_indices"),
                running.host_req_pool_indices("launch.req_pool_indices"),
            ]
        )
        rows = ext._rows().concat(running._rows())
        ends = torch.tensor(
            [p + e for p, e in zip(rows.prefix_lens, rows.extend_lens, strict=True)], dtype=_I64
        )
        self._assign(
            "prepare_for_mixed",
            reqs=KEEP,
            req_pool_indices=Mirrored(rpi, rpi_cpu),
            seq_lens=Mirrored(
                stream.compute(cat, ext.seq_lens, running.seq_lens, shape=n, dtype=_I64), ends
            ),
            committed=ends.clone(),
            rows=rows,
            step=StepTensors(
                stream.compute(
                    cat, ext.out_cache_loc, running.out_cache_loc, shape=n_tok, dtype=_I64
                ),
                stream.compute(
                    lambda a: torch.cat([a, a.new_zeros(n_dec)]),
                    ext.input_ids,
                    shape=n_tok,
                    dtype=_I64,
                ),
                stream.compute(cat, ext.positions, running.positions, shape=n_tok, dtype=_I64),
            ),
        )
        self.reads.known(rpi, rpi_cpu)
        self.mixed_rows = n_dec
        if ctx.table_journal is not None:
            # NOTE: a decode step's table entries are written by each worker itself
            # (`worker_lengths.locate`), an extend step's are not: this step sends them
            ctx.table_journal.append(
                (running.req_pool_indices, running.positions, running.out_cache_loc)
            )

    def prepare_for_verify(self, ks: list[int], base: torch.Tensor | None = None) -> None:
        """A speculative step: each row's last token and `ks[i]` drafts (resolved from the
        future map on the stream) at the device's own length, inside the window the host
        reserves up to its upper bound (`alloc_for_verify`). The device's lengths after the
        step start at `before + k + 1` and drop by the rejected drafts on the stream."""
        self.forward_mode = ForwardMode.VERIFY
        stream = self.ctx.stream
        # upper bounds (mirrors), or (legacy) the device's exact lengths, read through host_read
        if base is None:
            base = self.host_seq_lens("schedule.page_count")
        ns = [k + 1 for k in ks]
        n = len(self.reqs)
        layout = VerifyLayout.build(ks, stream.upload)
        rows, offsets = layout.rows, layout.offsets
        ns_cpu = torch.tensor(ns, dtype=_I64)
        before = self.seq_lens
        positions = stream.compute(
            lambda b, r, o: b[r] + o, before, rows, offsets, shape=(sum(ns),), dtype=_I64
        )
        out_cache_loc = alloc_for_verify(
            self.ctx, self.reqs, base.tolist(), ns, self.req_pool_indices, rows, positions
        )
        for req, m in zip(self.reqs, ns, strict=True):
            req.num_computed_tokens += m
            req.num_scheduled_outputs += m
            req.spec_window += m
            req.spec_drafts += m - 1
        ub = self.seq_lens_cpu + ns_cpu
        self._assign(
            "prepare_for_verify",
            reqs=KEEP,
            req_pool_indices=KEEP,
            # NOTE: out of place; the verify step lowers it by the rejected drafts on the stream
            seq_lens=Mirrored(
                stream.compute(torch.add, before, stream.upload(ns_cpu), shape=(n,), dtype=_I64),
                ub,
            ),
            committed=ub - torch.tensor([r.spec_window for r in self.reqs], dtype=_I64),
            rows=RowLists(
                base.tolist(),
                ns,
                [True] * n,
                [r.num_scheduled_outputs - m for r, m in zip(self.reqs, ns, strict=True)],
            ),
            step=StepTensors(out_cache_loc, None, positions),
        )
        self._verify = layout

    def settle_spec(self) -> None:
        """A verify step was processed: its rows' upper bounds dropped by the drafts it
        rejected and their committed lengths rose by what it accepted (host facts, on the
        requests). The mirrors follow; the device tensors already did, on the stream."""
        ub = torch.tensor([r.num_computed_tokens for r in self.reqs], dtype=_I64)
        committed = ub - torch.tensor([r.spec_window for r in self.reqs], dtype=_I64)
        if ub.equal(self.seq_lens_cpu) and committed.equal(self.committed_lens_cpu):
            return
        extend = self.extend_lens_cpu
        self._assign(
            "settle_spec",
            reqs=KEEP,
            req_pool_indices=KEEP,
            seq_lens=Mirrored(self.seq_lens, ub),
            committed=committed,
            rows=RowLists(
                [u - e for u, e in zip(ub.tolist(), extend, strict=True)],
                list(extend),
                list(self.output_rows),
                list(self.output_steps),
            ),
            step=KEEP,
        )

    def prepare_for_idle(self) -> None:
        self.forward_mode = ForwardMode.IDLE
        up = self.ctx.stream.upload
        empty_ids = up(_empty())
        self._assign(
            "prepare_for_idle",
            reqs=[],
            req_pool_indices=Mirrored(up(_empty()), _empty()),
            seq_lens=Mirrored(up(_empty()), _empty()),
            committed=_empty(),
            rows=RowLists.empty(),
            step=StepTensors(up(_empty()), empty_ids, empty_ids),
        )

    def prepare_for_import(self, imported: bool = True) -> None:
        """Requests whose KV already sits in their slots: imported with its first token
        (decode-side disaggregation), or (`imported=False`) paused requests that rejoin the
        decode batch, whose last token their own last step stashed."""
        self.forward_mode = ForwardMode.DECODE
        stream = self.ctx.stream
        rpi_cpu = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=_I64)
        seq_lens_cpu = torch.tensor([r.num_computed_tokens for r in self.reqs], dtype=_I64)
        n = len(self.reqs)
        rpi = stream.upload(rpi_cpu)
        self._assign(
            "prepare_for_import",
            reqs=KEEP,
            req_pool_indices=Mirrored(rpi, rpi_cpu),
            seq_lens=Mirrored(stream.upload(seq_lens_cpu), seq_lens_cpu),
            committed=seq_lens_cpu.clone(),
            # the first token came with the KV: like a final prefill chunk already processed
            rows=RowLists(seq_lens_cpu.tolist(), [0] * n, [False] * n, [0] * n),
            step=StepTensors(stream.upload(_empty()), None, None),
        )
        self.reads.known(rpi, rpi_cpu)  # the host's allocation
        fmap = self.ctx.future_map
        if imported and fmap.debug:  # the import stashed each first token (its debug stamp)
            slots = rpi_cpu.tolist()
            stream.submit(fmap.mark, stream.upload(rpi_cpu), fmap.plan_stash(slots))

    def filter_batch(self, keep_indices: list[int]) -> None:
        if keep_indices == list(range(len(self.reqs))):
            return
        stream = self.ctx.stream
        keep_cpu = torch.tensor(keep_indices, dtype=_I64)
        keep = stream.upload(keep_cpu)
        n = (len(keep_indices),)
        self._assign(
            "filter_batch",
            reqs=[self.reqs[i] for i in keep_indices],
            req_pool_indices=Mirrored(
                stream.compute(
                    torch.index_select, self.req_pool_indices, 0, keep, shape=n, dtype=_I64
                ),
                self.req_pool_indices_cpu[keep_cpu],
            ),
            seq_lens=Mirrored(
                stream.compute(torch.index_select, self.seq_lens, 0, keep, shape=n, dtype=_I64),
                self.seq_lens_cpu[keep_cpu],
            ),
            committed=self.committed_lens_cpu[keep_cpu],
            rows=self._rows().select(keep_indices),
            step=self._cleared_step(),
        )

    def merge_batch(self, other: ScheduleBatch) -> None:
        stream = self.ctx.stream
        n = (len(self.reqs) + len(other.reqs),)

        def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([a, b])

        self._assign(
            "merge_batch",
            reqs=self.reqs + other.reqs,
            req_pool_indices=Mirrored(
                stream.compute(
                    cat, self.req_pool_indices, other.req_pool_indices, shape=n, dtype=_I64
                ),
                torch.cat([self.req_pool_indices_cpu, other.req_pool_indices_cpu]),
            ),
            seq_lens=Mirrored(
                stream.compute(cat, self.seq_lens, other.seq_lens, shape=n, dtype=_I64),
                torch.cat([self.seq_lens_cpu, other.seq_lens_cpu]),
            ),
            committed=torch.cat([self.committed_lens_cpu, other.committed_lens_cpu]),
            rows=self._rows().concat(other._rows()),
            step=self._cleared_step(),
        )

    def _cleared_step(self) -> StepTensors:
        """Filter and merge change the rows: the last step's per-token tensors no longer fit.

        The batch is prepared again (decode) before it is launched.
        """
        empty = self.ctx.stream.upload(_empty())
        return StepTensors(empty, None, None)

    def retract_decode(self, ns: list[int] | None = None) -> tuple[list[Req], bool]:
        """Remove requests until one decode step fits the free KV pages (`ns`: a verify step
        of `ns[i]` tokens per row, each row's window counted).

        Victims have the fewest outputs, then the longest prompts, so the least work is redone.
        Returns them and whether the step now fits (it may not, with one request left).
        """
        allocator = self.ctx.allocator
        seq_lens_cpu = self.host_seq_lens("schedule.retract")
        if ns is None:
            needs = (seq_lens_cpu % allocator.page_size == 0).tolist()
        else:
            needs = [
                new_pages_needed(r, b + n, allocator.page_size)
                for r, b, n in zip(self.reqs, seq_lens_cpu.tolist(), ns, strict=True)
            ]
        needed, available = sum(needs), allocator.available_pages()
        order = retract_order(self.reqs)
        keep = set(range(len(self.reqs)))
        retracted: list[Req] = []
        for i in order:
            if available >= needed or len(keep) <= 1:
                break
            keep.discard(i)
            retracted.append(self.reqs[i])
            available += self.reqs[i].owned_pages  # its cached prefix stays locked a while
            needed -= needs[i]
        if retracted:
            self.filter_batch(sorted(keep))
        return retracted, available >= needed

    # ------------------------------------------------------------------ launch

    def to_forward_batch(self) -> ForwardBatch:
        ctx = self.ctx
        if ctx.check_mirrors:
            self._check_launchable()
        # host facts of this step, not mirror reads: the length after it, per row
        seq_lens_cpu = torch.tensor(
            [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu, strict=True)],
            dtype=_I64,
        )
        assert self.positions is not None
        return ForwardBatch(
            mode=self.forward_mode,
            batch_size=len(self.reqs),
            input_ids=self.input_ids if self.input_ids is not None else _empty(),
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            req_pool_indices_cpu=self.host_req_pool_indices("launch.req_pool_indices"),
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=list(self.extend_lens_cpu),
            prefix_lens_cpu=list(self.prefix_lens_cpu),
            req_to_token=ctx.req_to_token_pool.req_to_token,
            kv_cache=ctx.kv_cache,
            prompt_lens_cpu=[len(r.origin_input_ids) for r in self.reqs],
            sparse_plan=self._sparse_plan(),
            verify=self._verify if self.forward_mode is ForwardMode.VERIFY else None,
        )

    def step_input(self) -> StepInput:
        """What launching this batch needs: its forward tensors and its row lists."""
        with self.ctx.monitor.schedule_path():
            fb = self.to_forward_batch()
        return StepInput(
            fb, list(self.reqs), list(self.output_rows), list(self.output_steps), self.mixed_rows
        )

    def _sparse_plan(self) -> object:
        sparse = self.ctx.sparse
        if sparse is None:
            return None
        return sparse.plan_step(
            self.forward_mode,
            self.reqs,
            self.prefix_lens_cpu,
            self.extend_lens_cpu,
            self.output_rows,
        )

    # ------------------------------------------------------------------ debug

    def check_mirror_parity(self, op: str = "check") -> None:
        """Debug only: this syncs the stream. Raises `MirrorParityError` (`parity.py`)."""
        self._check_shapes(op)
        with self.ctx.monitor.debug_read():
            self.ctx.stream.synchronize()
            check_parity(
                op,
                self._mirrors(),
                self.reqs,
                self.prefix_lens_cpu,
                self.extend_lens_cpu,
                self.committed_lens_cpu,
            )

    def _check_launchable(self) -> None:
        check_launchable(self.reqs, self.extend_lens_cpu, self.out_cache_loc)
