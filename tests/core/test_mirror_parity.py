"""Mirror parity, property-tested over random sequences of batch operations."""

from __future__ import annotations

import ast
import inspect
import itertools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.scheduling import schedule_batch as schedule_batch_module
from stallfree.runtime.scheduling.alloc import (
    alloc_for_extend,
    decode_pages_needed,
    free_req_memory,
    verify_pages_needed,
)
from stallfree.runtime.scheduling.batch_fields import KEEP, Mirrored
from stallfree.runtime.scheduling.parity import MirrorParityError
from stallfree.runtime.scheduling.schedule_batch import (
    ASSIGNED_FIELDS,
    ScheduleBatch,
    retract_order,
)
from tests.batch_harness import make_ctx, make_req

OPS = [
    "extend",
    "chunk",
    "decode",
    "verify",
    "settle",
    "idle",
    "idle_used",
    "import",
    "filter",
    "merge",
    "retract",
]


class World:
    def __init__(self, ctx: BatchContext) -> None:
        self.ctx = ctx
        self.batches: list[ScheduleBatch] = []
        self.ids = itertools.count()
        # verify steps launched and not yet processed: (rows, drafts, accepted)
        self.in_flight: list[tuple[list[Req], list[int], list[int]]] = []

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
        if any(r.spec_drafts for r in batch.reqs):
            return  # the scheduler runs a verify step while drafts are in flight
        batch.prepare_for_decode()

    def op_verify(self, arg: int) -> None:
        """A speculative step: row i carries (arg >> i) % 4 drafts, within the context."""
        if not self.batches:
            return
        batch = self.batches[arg % len(self.batches)]
        if batch.is_empty():
            return
        limit = self.ctx.req_to_token_pool.max_context_len
        ub = batch.seq_lens_cpu.tolist()
        ks = [max(0, min((arg >> i) % 4, limit - 1 - u)) for i, u in enumerate(ub)]
        if max(ub) + 1 >= limit:
            return
        ps = self.ctx.allocator.page_size
        if verify_pages_needed(batch.reqs, ub, [k + 1 for k in ks], ps) > (
            self.ctx.allocator.available_pages()
        ):
            return
        batch.prepare_for_verify(ks)
        # the step itself, on the stream: row i accepts (arg >> (i + 2)) % (k + 1) drafts and
        # lowers its device length by the rest, as the verify step does
        accepted = [(arg >> (i + 2)) % (k + 1) for i, k in enumerate(ks)]
        rejected = torch.tensor([k - a for k, a in zip(ks, accepted, strict=True)])
        after = batch.seq_lens
        self.ctx.stream.submit(lambda: after.sub_(rejected))
        self.in_flight.append((list(batch.reqs), ks, accepted))

    def op_settle(self, arg: int) -> None:
        """The oldest verify step is processed: the host takes its rejected drafts off the
        bounds (as `SpecPolicy.settle` does) and every batch settles."""
        if not self.in_flight:
            return
        reqs, ks, accepted = self.in_flight.pop(0)
        alive = {id(r) for r in self.alive()}
        for req, k, a in zip(reqs, ks, accepted, strict=True):
            if id(req) not in alive:
                continue
            req.spec_window -= k + 1
            req.spec_drafts -= k
            req.num_computed_tokens -= k - a
            req.num_scheduled_outputs -= k - a
        for batch in self.batches:
            batch.settle_spec()

    def op_idle(self, arg: int) -> None:
        batch = ScheduleBatch.init_new([], self.ctx)
        batch.prepare_for_idle()
        self.batches.append(batch)

    def op_idle_used(self, arg: int) -> None:
        """A batch that held requests goes idle (as the scheduler's running batch does)."""
        if not self.batches:
            return
        batch = self.batches[arg % len(self.batches)]
        for req in batch.reqs:
            self.free(req)
        batch.prepare_for_idle()
        assert batch.req_pool_indices_cpu.numel() == 0 and batch.seq_lens_cpu.numel() == 0

    def op_import(self, arg: int) -> None:
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
        batch.prepare_for_import()
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
            n = len(batch.reqs)
            assert batch.req_pool_indices_cpu.tolist() == [r.req_pool_idx for r in batch.reqs]
            for rows in (batch.prefix_lens_cpu, batch.extend_lens_cpu, batch.output_rows):
                assert len(rows) == n  # per-row lists follow filter and merge
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
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 255)), max_size=30))
# the shapes random draws may miss: filter everything, merge two non-empty batches (in both
# orders, after decode steps, so the rows differ), idle on a batch that held requests
@example(ops=[("extend", 7), ("filter", 0), ("extend", 2), ("merge", 0)])
@example(ops=[("extend", 1), ("extend", 5), ("merge", 0), ("decode", 0), ("filter", 5)])
@example(
    ops=[("extend", 4), ("decode", 0), ("chunk", 3), ("merge", 1), ("decode", 0), ("merge", 0)]
)
@example(ops=[("extend", 2), ("decode", 0), ("extend", 3), ("merge", 1), ("decode", 1)])
@example(ops=[("extend", 5), ("decode", 0), ("idle_used", 0), ("extend", 1), ("merge", 0)])
@example(ops=[("import", 3), ("extend", 6), ("merge", 1), ("retract", 0), ("decode", 0)])
# speculative steps: two verify steps in flight, then processed in order, around a filter and
# a merge; a retraction with drafts in flight
@example(
    ops=[("extend", 5), ("verify", 255), ("verify", 6), ("filter", 3), ("settle", 1), ("settle", 0)]
)
@example(
    ops=[("extend", 4), ("extend", 1), ("verify", 7), ("merge", 0), ("settle", 255), ("verify", 2)]
)
@example(ops=[("extend", 3), ("verify", 255), ("retract", 0), ("settle", 2), ("decode", 0)])
def test_mirror_parity_after_every_operation(page_size: int, ops: list[tuple[str, int]]) -> None:
    ctx = make_ctx(page_size=page_size, num_tokens=256, num_reqs=12, max_context=96)
    ctx.spec_k = 3
    ctx.future_map.enable_spec(3, 96 + 5)
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


def test_parity_checker_catches_an_op_that_forgets_the_mirror(batch_ctx) -> None:
    ctx = batch_ctx()
    reqs = [make_req("a", 3), make_req("b", 5)]
    batch = SplitForgetsMirror.init_new(reqs, ctx)
    batch.prepare_for_extend([3, 5])
    batch.check_mirror_parity()
    batch.split_batch(1)
    with pytest.raises(AssertionError, match="mirror"):
        batch.check_mirror_parity()


class SpecForgetsCommitted(ScheduleBatch):
    """Batch ops that forget the speculative state: the checker catches each."""

    def filter_keeping_committed(self, keep: list[int]) -> None:
        k = torch.tensor(keep)
        self._assign(
            "filter_keeping_committed",
            reqs=[self.reqs[i] for i in keep],
            req_pool_indices=Mirrored(self.req_pool_indices[k], self.req_pool_indices_cpu[k]),
            seq_lens=Mirrored(self.seq_lens[k], self.seq_lens_cpu[k]),
            committed=KEEP,
            rows=self._rows().select(keep),
            step=self._cleared_step(),
        )

    def settle_bounds_only(self) -> None:
        ub = torch.tensor([r.num_computed_tokens for r in self.reqs])
        self._assign(
            "settle_bounds_only",
            reqs=KEEP,
            req_pool_indices=KEEP,
            seq_lens=Mirrored(self.seq_lens, ub),
            committed=KEEP,
            rows=KEEP,
            step=KEEP,
        )


def _verified(batch_ctx) -> tuple[SpecForgetsCommitted, list[int]]:
    """Two requests, one verify step of 2 and 3 drafts in flight (1 and 0 accepted)."""
    ctx = batch_ctx(check_mirrors=False)
    ctx.spec_k = 3
    ctx.future_map.enable_spec(3, 128)
    batch = SpecForgetsCommitted.init_new([make_req("a", 3), make_req("b", 5)], ctx)
    batch.prepare_for_extend([3, 5])
    batch.prepare_for_verify([2, 3])
    accepted = [1, 0]
    after = batch.seq_lens
    ctx.stream.submit(lambda: after.sub_(torch.tensor([1, 3])))
    return batch, accepted


def test_parity_checker_catches_an_op_that_forgets_the_speculative_state(batch_ctx) -> None:
    batch, _ = _verified(batch_ctx)
    batch.check_mirror_parity()  # in flight: committed <= device <= bound
    with pytest.raises(AssertionError, match="committed length mirror"):
        batch.filter_keeping_committed([1])


def test_parity_checker_catches_a_settle_that_forgets_the_committed_lengths(batch_ctx) -> None:
    batch, accepted = _verified(batch_ctx)
    for req, k, a in zip(batch.reqs, [2, 3], accepted, strict=True):  # as `settle` does
        req.spec_window -= k + 1
        req.spec_drafts -= k
        req.num_computed_tokens -= k - a
        req.num_scheduled_outputs -= k - a
    batch.settle_bounds_only()
    with pytest.raises(AssertionError, match="not the bound less the window"):
        batch.check_mirror_parity()
    batch.settle_spec()  # the real op
    batch.check_mirror_parity()
    assert batch.seq_lens_cpu.tolist() == [5, 6] == batch.committed_lens_cpu.tolist()


def test_legacy_mode_reads_device_through_host_read(batch_ctx) -> None:
    ctx = batch_ctx(cpu_mirrors=False)
    batch = ScheduleBatch.init_new([make_req("a", 3), make_req("b", 4)], ctx)
    batch.prepare_for_extend([3, 4])
    batch.prepare_for_decode()
    assert ctx.monitor.stall_counts["schedule.page_count"] == 1
    batch.check_mirror_parity()
    assert batch.seq_lens_cpu.tolist() == [4, 5]


def test_pools_refuse_double_free(batch_ctx) -> None:
    ctx = batch_ctx(page_size=2)
    slot = ctx.req_to_token_pool.alloc(1)[0]
    ctx.req_to_token_pool.free(slot)
    with pytest.raises(RuntimeError, match="double free of request slot"):
        ctx.req_to_token_pool.free(slot)
    pages = ctx.allocator.alloc_pages(2)
    ctx.allocator.free_pages(pages)
    with pytest.raises(RuntimeError, match="double free of KV page"):
        ctx.allocator.free_pages(pages[:1])


# ---------------------------------------------------------------------------- the checker


def _decoded_batch(ctx: BatchContext) -> ScheduleBatch:
    batch = ScheduleBatch.init_new([make_req("a", 3), make_req("b", 5), make_req("c", 4)], ctx)
    batch.prepare_for_extend([3, 5, 4])
    batch.prepare_for_decode()
    return batch


def _swap(t: torch.Tensor) -> torch.Tensor:
    return t.flip(0).clone()


CORRUPTIONS = {
    # the device tensor disagrees; its mirror still matches the requests
    "device req_pool_indices": lambda b: setattr(
        b, "req_pool_indices", b.ctx.stream.upload(_swap(b.req_pool_indices_cpu))
    ),
    "device seq_lens": lambda b: setattr(b, "seq_lens", b.ctx.stream.upload(b.seq_lens_cpu + 1)),
    # the mirror disagrees with its device tensor
    "mirror req_pool_indices": lambda b: setattr(
        b, "req_pool_indices_cpu", _swap(b.req_pool_indices_cpu)
    ),
    "mirror seq_lens": lambda b: setattr(b, "seq_lens_cpu", b.seq_lens_cpu - 1),
    "mirror dtype": lambda b: setattr(b, "seq_lens_cpu", b.seq_lens_cpu.to(torch.int32)),
    "mirror length": lambda b: setattr(b, "req_pool_indices_cpu", b.req_pool_indices_cpu[:2]),
    "mirror is the device tensor": lambda b: setattr(b, "seq_lens_cpu", b.seq_lens),
    "mirror shares device memory": lambda b: setattr(b, "seq_lens_cpu", b.seq_lens[:]),
    # both tensors agree, but not with the requests
    "rows out of step with reqs": lambda b: setattr(b, "reqs", b.reqs[::-1]),
    "stale per-row list": lambda b: setattr(b, "prefix_lens_cpu", b.prefix_lens_cpu[:2]),
    "per-row list out of order": lambda b: setattr(b, "prefix_lens_cpu", b.prefix_lens_cpu[::-1]),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_the_parity_checker_fires_on_each_kind_of_corruption(kind: str, batch_ctx) -> None:
    ctx = batch_ctx()
    batch = _decoded_batch(ctx)
    batch.check_mirror_parity()
    ctx.stream.synchronize()
    CORRUPTIONS[kind](batch)
    with pytest.raises(MirrorParityError):
        batch.check_mirror_parity()


def test_the_checker_runs_after_every_batch_op_with_check_mirrors(batch_ctx) -> None:
    ctx = batch_ctx(check_mirrors=True)
    batch = _decoded_batch(ctx)
    batch.req_pool_indices = ctx.stream.upload(_swap(batch.req_pool_indices_cpu))
    with pytest.raises(MirrorParityError, match="prepare_for_decode: req_pool_indices_cpu"):
        batch.prepare_for_decode()
    lax = batch_ctx(check_mirrors=False)
    batch = _decoded_batch(lax)
    batch.req_pool_indices = lax.stream.upload(_swap(batch.req_pool_indices_cpu))
    batch.prepare_for_decode()  # off: nothing compares values (shapes are always checked)


def test_the_suite_runs_with_check_mirrors_on(batch_ctx) -> None:
    from stallfree.config import load_config

    assert load_config().runtime.check_mirrors
    assert batch_ctx().check_mirrors


def test_a_request_released_between_steps_is_not_a_mismatch(batch_ctx) -> None:
    """Overlap off: a request aborted between steps is released at once, but stays in the
    running batch until the next filter. Merging the last prefill into that batch first must
    not look like a corrupted mirror."""
    ctx = batch_ctx(check_mirrors=True)
    running = _decoded_batch(ctx)
    victim = running.reqs[1]
    victim.finish(FinishReason.ABORT)
    free_req_memory(ctx.req_to_token_pool, ctx.allocator, victim)
    late = ScheduleBatch.init_new([make_req("d", 4)], ctx)
    late.prepare_for_extend([4])
    running.merge_batch(late)  # checked: the released row is skipped
    running.filter_batch([i for i, r in enumerate(running.reqs) if not r.finished])
    assert [r.rid for r in running.reqs] == ["a", "c", "d"]
    # a row that lost its slot without finishing is still a mismatch
    running.reqs[0].req_pool_idx = None
    with pytest.raises(MirrorParityError, match="row 0"):
        running.check_mirror_parity()


# ---------------------------------------------------------------------------- structure


def test_only_assign_sets_the_fields_of_a_batch() -> None:
    """Structural: a new batch op cannot set a device tensor without its mirror, or leave a
    per-row list behind, because no method but `_assign` may set these fields at all."""
    tree = ast.parse(inspect.getsource(schedule_batch_module))
    offenders = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ScheduleBatch"):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            if fn.name == "_assign":
                continue
            for node in ast.walk(fn):
                targets: list[ast.expr] = []
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr"
                ):
                    offenders.append(f"{fn.name}: setattr")
                for t in targets:
                    for sub in ast.walk(t):
                        if (
                            isinstance(sub, ast.Attribute)
                            and isinstance(sub.value, ast.Name)
                            and sub.value.id == "self"
                            and sub.attr in ASSIGNED_FIELDS
                        ):
                            offenders.append(f"{fn.name}: self.{sub.attr}")
    assert not offenders, offenders


def test_per_row_fields_follow_filter_and_merge(batch_ctx) -> None:
    ctx = batch_ctx()
    a, b, c = make_req("a", 3), make_req("b", 5, max_new_tokens=4), make_req("c", 4)
    first = ScheduleBatch.init_new([a, b, c], ctx)
    first.prepare_for_extend([3, 5, 2])  # c is chunked: no output row
    first.filter_batch([0, 2])
    assert first.reqs == [a, c]
    assert (first.prefix_lens_cpu, first.extend_lens_cpu) == ([0, 0], [3, 2])
    assert (first.output_rows, first.output_steps) == ([True, False], [0, 0])
    assert first.out_cache_loc.numel() == 0  # per-token tensors do not survive a filter
    d = make_req("d", 6)
    second = ScheduleBatch.init_new([d], ctx)
    second.prepare_for_extend([6])
    first.merge_batch(second)
    assert first.reqs == [a, c, d]
    assert (first.prefix_lens_cpu, first.extend_lens_cpu) == ([0, 0, 0], [3, 2, 6])
    assert first.output_rows == [True, False, True]
    assert first.seq_lens_cpu.tolist() == [3, 2, 6]


def test_a_filtered_batch_must_be_prepared_again_before_launch(batch_ctx) -> None:
    ctx = batch_ctx()
    batch = _decoded_batch(ctx)
    batch.filter_batch([0, 2])
    with pytest.raises(MirrorParityError, match="prepared again"):
        batch.to_forward_batch()
    batch.prepare_for_decode()
    assert batch.to_forward_batch().batch_size == 2


def test_alloc_for_extend_contract(batch_ctx) -> None:
    """(out_cache_loc, device slots, host slots): the first two are the stream's tensors, the
    third is the mirror, a host int64 tensor that is neither of them nor shares their memory."""
    ctx = batch_ctx(strict=True, page_size=2)
    guard = ctx.monitor.guard
    assert guard is not None
    reqs = [make_req("a", 3), make_req("b", 5)]
    out_cache_loc, device, host = alloc_for_extend(ctx, reqs, [3, 5])
    slots = [r.req_pool_idx for r in reqs]
    for t in (out_cache_loc, device):
        assert t.device == ctx.stream.device and t.dtype == torch.int64
        assert guard.owns(t)  # produced by the stream
    assert host.device.type == "cpu" and host.dtype == torch.int64
    assert host is not device and not guard.owns(host)
    assert host.untyped_storage().data_ptr() != device.untyped_storage().data_ptr()
    assert host.tolist() == slots
    assert tuple(device.shape) == (2,) and tuple(out_cache_loc.shape) == (8,)
    ctx.stream.synchronize()
    assert device.tolist() == slots


def test_an_idle_batch_has_empty_mirrors(batch_ctx) -> None:
    ctx = batch_ctx()
    batch = _decoded_batch(ctx)
    for req in batch.reqs:
        free_req_memory(ctx.req_to_token_pool, ctx.allocator, req)
    batch.prepare_for_idle()
    for t in (batch.req_pool_indices_cpu, batch.seq_lens_cpu):
        assert t.dtype == torch.int64 and t.device.type == "cpu" and t.numel() == 0
    ctx.stream.synchronize()
    assert batch.req_pool_indices.numel() == 0 and batch.seq_lens.numel() == 0
    assert batch.reqs == [] and batch.prefix_lens_cpu == [] and batch.output_rows == []


# ---------------------------------------------------------------------------- retraction order


def _req_with_outputs(rid: str, prompt: int, outputs: int) -> Req:
    req = make_req(rid, prompt, max_new_tokens=64)
    req.output_ids = list(range(outputs))
    req.num_scheduled_outputs = outputs
    return req


def test_retraction_takes_fewest_outputs_first_then_longest_prompt(batch_ctx) -> None:
    """SGLang's policy, on a batch where each other order would retract someone else.

    The step needs 4 pages and none is free; one victim frees enough. Fewest outputs first
    takes a or c (no outputs), and the longest prompt among them, a. Most outputs first would
    take d; shortest prompt first among the outputless would take c.
    """
    ctx = batch_ctx(page_size=1, num_tokens=128)
    reqs = [
        _req_with_outputs("a", 10, 0),
        _req_with_outputs("b", 4, 3),
        _req_with_outputs("c", 8, 0),
        _req_with_outputs("d", 2, 5),
    ]
    assert [reqs[i].rid for i in retract_order(reqs)] == ["a", "c", "b", "d"]
    batch = ScheduleBatch.init_new(reqs, ctx)
    batch.prepare_for_extend([r.fill_len for r in reqs])
    hold = ctx.allocator.alloc_pages(ctx.allocator.available_pages())
    retracted, fits = batch.retract_decode()
    assert [r.rid for r in retracted] == ["a"] and fits
    assert [r.rid for r in batch.reqs] == ["b", "c", "d"]  # the survivors
    batch.check_mirror_parity()
    ctx.allocator.free_pages(hold)


def test_retraction_keeps_taking_in_order_until_the_step_fits(batch_ctx) -> None:
    ctx = batch_ctx(page_size=1, num_tokens=128)
    reqs = [_req_with_outputs(f"r{i}", n, o) for i, (n, o) in enumerate([(3, 2), (2, 0), (3, 0)])]
    batch = ScheduleBatch.init_new(reqs, ctx)
    batch.prepare_for_extend([r.fill_len for r in reqs])
    hold = ctx.allocator.alloc_pages(ctx.allocator.available_pages())
    ctx.allocator.free_pages(hold[:1])  # one free page; the step needs three
    retracted, fits = batch.retract_decode()
    # r2 (no outputs, prompt 3) frees 3 pages: 4 free, 2 needed
    assert [r.rid for r in retracted] == ["r2"] and fits
    assert [r.rid for r in batch.reqs] == ["r0", "r1"]
    ctx.allocator.free_pages(hold[1:])


# ---------------------------------------------------------------------------- legacy mode


def test_legacy_launch_reads_the_slots_from_the_device_not_the_mirror(batch_ctx) -> None:
    ctx = batch_ctx(cpu_mirrors=False, check_mirrors=False)
    batch = ScheduleBatch.init_new([make_req("a", 3), make_req("b", 4)], ctx)
    batch.prepare_for_extend([3, 4])
    batch.prepare_for_decode()  # one read at schedule.page_count: lengths and slots
    device_slots = batch.req_pool_indices_cpu.tolist()
    batch.req_pool_indices_cpu = torch.tensor([99, 98], dtype=torch.int64)  # a stale mirror
    fb = batch.to_forward_batch()
    assert fb.req_pool_indices_cpu.tolist() == device_slots  # read from the device
    assert ctx.monitor.stall_counts == {"schedule.page_count": 1}
    assert ctx.monitor.mirror_reads == {}
    batch.filter_batch([1])
    batch.req_pool_indices_cpu = torch.tensor([97], dtype=torch.int64)
    batch.prepare_for_decode()
    assert batch.to_forward_batch().req_pool_indices_cpu.tolist() == device_slots[1:]
    assert ctx.monitor.stall_counts == {"schedule.page_count": 2}
