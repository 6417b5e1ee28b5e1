"""Mirror parity, property-tested over random sequences of batch operations."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallfree.runtime.alloc import decode_pages_needed, free_req_memory
from stallfree.runtime.context import BatchContext
from stallfree.runtime.req import Req
from stallfree.runtime.schedule_batch import ScheduleBatch
from tests.batch_harness import make_ctx, make_req

OPS = ["extend", "chunk", "decode", "idle", "prebuilt", "filter", "merge", "retract"]


class World:
    def __init__(self, ctx: BatchContext) -> None:
        self.ctx = ctx
        self.batches: list[ScheduleBatch] = []
        self.ids = itertools.count()

    def alive(self) -> list[Req]:
        return [r for b in self.batches for r in b.reqs]

    def free(self, req: Req) -> None:
        free_req_memory(self.ctx.req_to_token_pool, self.ctx.allocator, req)

    def fits(self, tokens: int, reqs: int = 1) -> bool:
        a = self.ctx.allocator
        return (
            a.available_pages() >= -(-tokens // a.page_size) + reqs
            and self.ctx.req_to_token_pool.available_size() >= reqs
        )

    def apply(self, op: str, arg: int) -> None:
        getattr(self, f"op_{op}")(arg)

    def op_extend(self, arg: int) -> None:
        lens = [1 + (arg * (i + 3)) % 20 for i in range(1 + arg % 3)]
        if not self.fits(sum(lens), len(lens)):
            return
        reqs = [make_req(f"r{next(self.ids)}", n) for n in lens]
        batch = ScheduleBatch.init_new(reqs, self.ctx)
        batch.prepare_for_extend(lens)
        self.batches.append(batch)

    def op_chunk(self, arg: int) -> None:
        """A prompt prefilled in two chunks, the second one in a new batch."""
        n = 4 + arg % 20
        if not self.fits(n):
            return
        req = make_req(f"r{next(self.ids)}", n)
        first = ScheduleBatch.init_new([req], self.ctx)
        first.prepare_for_extend([n // 2])
        second = ScheduleBatch.init_new([req], self.ctx)
        second.prepare_for_extend([n - n // 2])
        self.batches.append(second)

    def op_decode(self, arg: int) -> None:
        if not self.batches:
            return
        batch = self.batches[arg % len(self.batches)]
        if batch.is_empty():
            return
        need = decode_pages_needed(batch.seq_lens_cpu, self.ctx.allocator.page_size)
        if need > self.ctx.allocator.available_pages():
            return
        if int(batch.seq_lens_cpu.max()) + 1 >= self.ctx.req_to_token_pool.max_context_len:
            return
        batch.prepare_for_decode()

    def op_idle(self, arg: int) -> None:
        batch = ScheduleBatch.init_new([], self.ctx)
        batch.prepare_for_idle()
        self.batches.append(batch)

    def op_prebuilt(self, arg: int) -> None:
        n = 1 + arg % 12
        if not self.fits(n):
            return
        req = make_req(f"r{next(self.ids)}", n)
        req.req_pool_idx = self.ctx.req_to_token_pool.alloc(1)[0]
        ps = self.ctx.allocator.page_size
        req.kv_pages = self.ctx.allocator.alloc_pages(-(-n // ps))
        req.num_computed_tokens = n
        pos = torch.arange(n)
        locs = torch.tensor(req.kv_pages)[pos // ps] * ps + pos % ps
        table = self.ctx.req_to_token_pool.req_to_token
        self.ctx.stream.submit(table.__setitem__, (req.req_pool_idx, slice(0, n)), locs)
        batch = ScheduleBatch.init_new([req], self.ctx)
        batch.prepare_for_prebuilt()
        self.batches.append(batch)

    def op_filter(self, arg: int) -> None:
        if not self.batches:
            return
        batch = self.batches[arg % len(self.batches)]
        keep = [i for i in range(len(batch.reqs)) if (arg >> (i % 8)) & 1]
        for i, req in enumerate(batch.reqs):
            if i not in keep:
                self.free(req)
        batch.filter_batch(keep)

    def op_merge(self, arg: int) -> None:
        if len(self.batches) < 2:
            return
        a = self.batches[arg % len(self.batches)]
        b = self.batches[(arg + 1) % len(self.batches)]
        a.merge_batch(b)
        self.batches.remove(b)

    def op_retract(self, arg: int) -> None:
        if not self.batches:
            return
        batch = self.batches[arg % len(self.batches)]
        if len(batch) < 2:
            return
        # exhaust the pool so the next decode step cannot fit, then retract
        hold = self.ctx.allocator.alloc_pages(self.ctx.allocator.available_pages()) or []
        retracted, _ = batch.retract_decode()
        self.ctx.allocator.free_pages(hold)
        for req in retracted:
            self.free(req)

    def check(self) -> None:
        for batch in self.batches:
            batch.check_mirror_parity()
        alive = self.alive()
        pool, allocator = self.ctx.req_to_token_pool, self.ctx.allocator
        assert pool.available_size() == pool.size - len(alive)
        assert allocator.available_pages() == allocator.num_pages - sum(
            len(r.kv_pages) for r in alive
        )
        for req in alive:  # host page table agrees with the device req_to_token row
            row = pool.req_to_token[req.req_pool_idx, : req.num_computed_tokens]
            ps = allocator.page_size
            pos = torch.arange(req.num_computed_tokens)
            want = torch.tensor(req.kv_pages, dtype=torch.int64)[pos // ps] * ps + pos % ps
            assert row.equal(want)


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 255)), max_size=30))
def test_mirror_parity_after_every_operation(page_size: int, ops: list[tuple[str, int]]) -> None:
    ctx = make_ctx(page_size=page_size, num_tokens=256, num_reqs=12, max_context=96)
    world = World(ctx)
    try:
        for op, arg in ops:
            world.apply(op, arg)
            world.check()
        for req in world.alive():
            world.free(req)
        assert ctx.allocator.available_pages() == ctx.allocator.num_pages
        assert ctx.req_to_token_pool.available_size() == ctx.req_to_token_pool.size
    finally:
        ctx.stream.close()


class SplitForgetsMirror(ScheduleBatch):
    """A new batch op that forgets the mirror (the risk DESIGN.md names): the checker catches it."""

    def split_batch(self, n: int) -> None:
        self.reqs = self.reqs[:n]
        self.req_pool_indices = self.ctx.stream.compute(
            lambda t: t[:n], self.req_pool_indices, shape=(n,), dtype=torch.int64
        )
        self.seq_lens = self.ctx.stream.compute(
            lambda t: t[:n], self.seq_lens, shape=(n,), dtype=torch.int64
        )


def test_parity_checker_catches_an_op_that_forgets_the_mirror() -> None:
    ctx = make_ctx()
    reqs = [make_req("a", 3), make_req("b", 5)]
    batch = SplitForgetsMirror.init_new(reqs, ctx)
    batch.prepare_for_extend([3, 5])
    batch.check_mirror_parity()
    batch.split_batch(1)
    with pytest.raises(AssertionError, match="mirror"):
        batch.check_mirror_parity()
    ctx.stream.close()


def test_legacy_mode_reads_device_through_host_read() -> None:
    ctx = make_ctx(cpu_mirrors=False)
    batch = ScheduleBatch.init_new([make_req("a", 3), make_req("b", 4)], ctx)
    batch.prepare_for_extend([3, 4])
    batch.prepare_for_decode()
    assert ctx.monitor.stall_counts["schedule.page_count"] == 1
    batch.check_mirror_parity()
    assert batch.seq_lens_cpu.tolist() == [4, 5]
    ctx.stream.close()


def test_pools_refuse_double_free() -> None:
    ctx = make_ctx(page_size=2)
    slot = ctx.req_to_token_pool.alloc(1)[0]
    ctx.req_to_token_pool.free(slot)
    with pytest.raises(RuntimeError, match="double free of request slot"):
        ctx.req_to_token_pool.free(slot)
    pages = ctx.allocator.alloc_pages(2)
    ctx.allocator.free_pages(pages)
    with pytest.raises(RuntimeError, match="double free of KV page"):
        ctx.allocator.free_pages(pages[:1])
    ctx.stream.close()
