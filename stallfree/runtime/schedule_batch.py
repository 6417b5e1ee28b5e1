"""`ScheduleBatch`: a batch's device tensors and their CPU mirrors, kept in step by every op.

Device tensors (`req_pool_indices`, `seq_lens`, `out_cache_loc`, `input_ids`) are produced by
uploads or by work enqueued on the stream, always out of place: once a batch is launched its
tensors belong to the stream. The mirrors (`req_pool_indices_cpu`, `seq_lens_cpu`) are what the
schedule path reads. With `cpu_mirrors=false` (legacy) consumers read the device tensors through
`host_read` instead, which stalls until the stream drains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from stallfree.runtime.alloc import alloc_for_decode, alloc_for_extend
from stallfree.runtime.context import BatchContext
from stallfree.runtime.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from stallfree.runtime.req import Req

_I64 = torch.int64


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=_I64)


@dataclass(slots=True, eq=False)
class ScheduleBatch:
    reqs: list[Req]
    ctx: BatchContext
    forward_mode: ForwardMode = ForwardMode.IDLE
    req_pool_indices: torch.Tensor = field(default_factory=_empty)
    req_pool_indices_cpu: torch.Tensor = field(default_factory=_empty)
    seq_lens: torch.Tensor = field(default_factory=_empty)
    seq_lens_cpu: torch.Tensor = field(default_factory=_empty)
    out_cache_loc: torch.Tensor = field(default_factory=_empty)
    input_ids: torch.Tensor | None = None  # None in decode: resolved from the future map
    positions: torch.Tensor | None = None
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # rows whose sampled token is real (a final prefill chunk, or any decode row)
    output_rows: list[bool] = field(default_factory=list)
    # output index each row's token will have (seeded sampling)
    output_steps: list[int] = field(default_factory=list)

    @classmethod
    def init_new(cls, reqs: list[Req], ctx: BatchContext) -> ScheduleBatch:
        return cls(reqs=list(reqs), ctx=ctx)

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ------------------------------------------------------------------ host reads

    def host_seq_lens(self, site: str) -> torch.Tensor:
        """Sequence lengths on the host: the mirror, or (legacy) a device read at `site`."""
        if self.ctx.cpu_mirrors:
            self.ctx.monitor.mirror_read("seq_lens_cpu")
            return self.seq_lens_cpu
        return self.ctx.monitor.host_read(self.seq_lens, site)

    # ------------------------------------------------------------------ lifecycle

    def prepare_for_extend(self, extend_lens: list[int]) -> None:
        self.forward_mode = ForwardMode.EXTEND
        stream = self.ctx.stream
        self.prefix_lens_cpu = [r.num_computed_tokens for r in self.reqs]
        self.extend_lens_cpu = list(extend_lens)
        ids, pos = [], []
        for req, prefix, ext in zip(self.reqs, self.prefix_lens_cpu, extend_lens, strict=True):
            ids.extend(req.fill_slice(prefix, prefix + ext))
            pos.append(torch.arange(prefix, prefix + ext, dtype=_I64))
        self.out_cache_loc, self.req_pool_indices, self.req_pool_indices_cpu = alloc_for_extend(
            self.ctx, self.reqs, extend_lens
        )
        self.seq_lens_cpu = torch.tensor(
            [p + e for p, e in zip(self.prefix_lens_cpu, extend_lens, strict=True)], dtype=_I64
        )
        self.seq_lens = stream.upload(self.seq_lens_cpu)
        self.input_ids = stream.upload(torch.tensor(ids, dtype=_I64))
        self.positions = stream.upload(torch.cat(pos) if pos else _empty())
        self.output_rows, self.output_steps = [], []
        for req, ext in zip(self.reqs, extend_lens, strict=True):
            req.num_computed_tokens += ext
            final = req.num_computed_tokens == req.fill_len
            self.output_rows.append(final)
            self.output_steps.append(req.num_scheduled_outputs)
            if final:
                req.num_scheduled_outputs += 1
        self._check()

    def prepare_for_decode(self, seq_lens_host: torch.Tensor | None = None) -> None:
        """`seq_lens_host`: lengths the caller already read for this batch, if any."""
        self.forward_mode = ForwardMode.DECODE
        stream = self.ctx.stream
        if seq_lens_host is None:
            seq_lens_host = self.host_seq_lens("schedule.page_count")
        self.prefix_lens_cpu = seq_lens_host.tolist()
        self.extend_lens_cpu = [1] * len(self.reqs)
        self.out_cache_loc = alloc_for_decode(
            self.ctx, self.reqs, seq_lens_host, self.req_pool_indices, self.seq_lens
        )
        self.positions = self.seq_lens  # the new token sits at the old length
        # NOTE: out of place: the launched batch still owns the old `seq_lens`.
        self.seq_lens = stream.compute(
            torch.add, self.seq_lens, 1, shape=tuple(self.seq_lens.shape), dtype=_I64
        )
        self.seq_lens_cpu = self.seq_lens_cpu + 1
        self.input_ids = None
        self.output_rows = [True] * len(self.reqs)
        self.output_steps = [r.num_scheduled_outputs for r in self.reqs]
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
        self._check()

    def prepare_for_idle(self) -> None:
        self.forward_mode = ForwardMode.IDLE
        self.reqs = []
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            setattr(self, name, self.ctx.stream.upload(_empty()))
        self.req_pool_indices_cpu = _empty()
        self.seq_lens_cpu = _empty()
        self.input_ids = self.ctx.stream.upload(_empty())
        self.positions = self.input_ids
        self.prefix_lens_cpu, self.extend_lens_cpu = [], []
        self.output_rows, self.output_steps = [], []
        self._check()

    def prepare_for_prebuilt(self) -> None:
        """Requests whose prompt KV already sits in their slots (decode-side disaggregation)."""
        self.forward_mode = ForwardMode.DECODE
        stream = self.ctx.stream
        self.req_pool_indices_cpu = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=_I64)
        self.seq_lens_cpu = torch.tensor([r.num_computed_tokens for r in self.reqs], dtype=_I64)
        self.req_pool_indices = stream.upload(self.req_pool_indices_cpu)
        self.seq_lens = stream.upload(self.seq_lens_cpu)
        self.out_cache_loc = stream.upload(_empty())
        self._check()

    def filter_batch(self, keep_indices: list[int]) -> None:
        if keep_indices == list(range(len(self.reqs))):
            return
        stream = self.ctx.stream
        keep_cpu = torch.tensor(keep_indices, dtype=_I64)
        keep = stream.upload(keep_cpu)
        self.reqs = [self.reqs[i] for i in keep_indices]
        n = (len(keep_indices),)
        self.req_pool_indices = stream.compute(
            torch.index_select, self.req_pool_indices, 0, keep, shape=n, dtype=_I64
        )
        self.seq_lens = stream.compute(
            torch.index_select, self.seq_lens, 0, keep, shape=n, dtype=_I64
        )
        self.req_pool_indices_cpu = self.req_pool_indices_cpu[keep_cpu]
        self.seq_lens_cpu = self.seq_lens_cpu[keep_cpu]
        self._check()

    def merge_batch(self, other: ScheduleBatch) -> None:
        stream = self.ctx.stream
        self.reqs = self.reqs + other.reqs
        n = (len(self.reqs),)
        self.req_pool_indices = stream.compute(
            lambda a, b: torch.cat([a, b]),
            self.req_pool_indices,
            other.req_pool_indices,
            shape=n,
            dtype=_I64,
        )
        self.seq_lens = stream.compute(
            lambda a, b: torch.cat([a, b]), self.seq_lens, other.seq_lens, shape=n, dtype=_I64
        )
        self.req_pool_indices_cpu = torch.cat(
            [self.req_pool_indices_cpu, other.req_pool_indices_cpu]
        )
        self.seq_lens_cpu = torch.cat([self.seq_lens_cpu, other.seq_lens_cpu])
        self._check()

    def retract_decode(self) -> tuple[list[Req], bool]:
        """Remove requests until one decode step fits the free KV pages.

        Victims have the fewest outputs, then the longest prompts, so the least work is redone.
        Returns them and whether the step now fits (it may not, with one request left).
        """
        allocator = self.ctx.allocator
        seq_lens_host = self.host_seq_lens("schedule.retract")
        needs = (seq_lens_host % allocator.page_size == 0).tolist()
        needed, available = sum(needs), allocator.available_pages()
        order = sorted(
            range(len(self.reqs)),
            key=lambda i: (len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)),
        )
        keep = set(range(len(self.reqs)))
        retracted: list[Req] = []
        for i in order:
            if available >= needed or len(keep) <= 1:
                break
            keep.discard(i)
            retracted.append(self.reqs[i])
            available += len(self.reqs[i].kv_pages)
            needed -= needs[i]
        if retracted:
            self.filter_batch(sorted(keep))
        return retracted, available >= needed

    # ------------------------------------------------------------------ launch

    def to_forward_batch(self) -> ForwardBatch:
        ctx = self.ctx
        if self.forward_mode is ForwardMode.DECODE:
            seq_lens_host = torch.tensor(self.prefix_lens_cpu, dtype=_I64) + 1
        else:
            seq_lens_host = self.seq_lens_cpu
        assert self.positions is not None
        return ForwardBatch(
            mode=self.forward_mode,
            batch_size=len(self.reqs),
            input_ids=self.input_ids if self.input_ids is not None else _empty(),
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            req_pool_indices_cpu=self.req_pool_indices_cpu,
            seq_lens_cpu=seq_lens_host,
            extend_lens_cpu=list(self.extend_lens_cpu),
            prefix_lens_cpu=list(self.prefix_lens_cpu),
            req_to_token=ctx.req_to_token_pool.req_to_token,
            kv_cache=ctx.kv_cache,
            prompt_lens_cpu=[len(r.origin_input_ids) for r in self.reqs],
            sparse_plan=self._sparse_plan(),
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

    def check_mirror_parity(self) -> None:
        """Debug only: this syncs the stream."""
        self.ctx.stream.synchronize()
        assert self.req_pool_indices_cpu.dtype == _I64 and self.seq_lens_cpu.dtype == _I64
        assert self.req_pool_indices_cpu.equal(self.req_pool_indices.cpu()), (
            f"req_pool_indices mirror {self.req_pool_indices_cpu.tolist()} != "
            f"device {self.req_pool_indices.cpu().tolist()}"
        )
        assert self.seq_lens_cpu.equal(self.seq_lens.cpu()), (
            f"seq_lens mirror {self.seq_lens_cpu.tolist()} != device {self.seq_lens.cpu().tolist()}"
        )
        expected = [r.req_pool_idx for r in self.reqs]
        assert self.req_pool_indices_cpu.tolist() == expected, "mirror out of step with reqs"

    def _check(self) -> None:
        if self.ctx.check_mirrors:
            self.check_mirror_parity()
