"""Strict mode's read guard: the CPU analogue of `torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from stallfree import Engine
from stallfree.overlap.host_read import ScheduleSyncError, SyncMonitor
from stallfree.overlap.strict import StrictGuard, StrictReadError
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from tests.batch_harness import make_req
from tests.engine_util import engine_config, guarded, random_prompts, run_greedy


def _decode_batch(batch_ctx, strict: bool = True, cpu_mirrors: bool = True):
    ctx = batch_ctx(strict=strict, cpu_mirrors=cpu_mirrors)
    assert ctx.monitor.enable_read_guard() is not None  # strict has it; legacy asks for it
    batch = ScheduleBatch.init_new([make_req("a", 3), make_req("b", 4)], ctx)
    with ctx.monitor.schedule_path():
        batch.prepare_for_extend([3, 4])
        batch.prepare_for_decode()
    return ctx, batch


# every way the schedule path could read a device value, and how the error names it
READS = {
    ".cpu()": lambda b, ctx: b.req_pool_indices.cpu(),
    ".tolist()": lambda b, ctx: b.seq_lens.tolist(),
    ".item()": lambda b, ctx: b.seq_lens.sum().item(),
    ".numpy()": lambda b, ctx: b.seq_lens.numpy(),
    "numpy.asarray()": lambda b, ctx: np.asarray(b.seq_lens),
    "bool()": lambda b, ctx: bool(b.seq_lens.max()),
    "int()": lambda b, ctx: int(b.seq_lens.max()),
    "indexing []": lambda b, ctx: b.seq_lens[0],
    ".to()": lambda b, ctx: b.seq_lens.to("cpu"),
    "torch.cat()": lambda b, ctx: torch.cat([b.seq_lens, b.seq_lens]),
    ".add_()": lambda b, ctx: b.seq_lens.add_(1),  # an in-place update on the host
    "stream.synchronize()": lambda b, ctx: ctx.stream.synchronize(),
    "event.synchronize()": lambda b, ctx: ctx.stream.record_event().synchronize(),
    "req_to_token": lambda b, ctx: ctx.req_to_token_pool.req_to_token[0, 0],
}
SPELLED = {
    "numpy.asarray()": ".numpy() / numpy.asarray()",
    "req_to_token": "indexing []",
    "bool()": ".max()",  # the reduction is already a read of the device tensor
    "int()": ".max()",
    ".item()": ".sum()",
}


@pytest.mark.parametrize("how", list(READS))
def test_every_read_of_a_stream_tensor_on_the_schedule_path_raises_naming_the_site(how, batch_ctx):
    ctx, batch = _decode_batch(batch_ctx)
    if how == "req_to_token":
        ctx.stream.adopt(ctx.req_to_token_pool.req_to_token)  # the runner adopts pool state
    read = READS[how]
    with ctx.monitor.schedule_path(), pytest.raises(StrictReadError) as err:
        read(batch, ctx)
    message = str(err.value)
    assert SPELLED.get(how, how) in message
    assert "test_strict_guard.py:" in message  # the call site, not torch or the guard


@pytest.mark.parametrize("how", ["bool()", "int()", ".item()"])
def test_scalar_reads_of_a_zero_dim_stream_tensor_are_named(how, batch_ctx):
    ctx = batch_ctx(strict=True)
    t = ctx.stream.compute(torch.add, torch.tensor(1), 1, shape=(), dtype=torch.int64)
    read = {"bool()": bool, "int()": int, ".item()": lambda x: x.item()}[how]
    with ctx.monitor.schedule_path(), pytest.raises(StrictReadError, match=rf"{how[:-2]}"):
        read(t)


def test_metadata_mirrors_and_host_state_stay_readable(batch_ctx):
    ctx, batch = _decode_batch(batch_ctx)
    with ctx.monitor.schedule_path():
        assert tuple(batch.seq_lens.shape) == (2,) and len(batch.seq_lens) == 2
        assert batch.seq_lens.dtype == torch.int64 and batch.seq_lens.device.type == "cpu"
        assert batch.seq_lens.numel() == 2 and batch.seq_lens.dim() == 1
        assert batch.seq_lens_cpu.tolist() == [4, 5]  # the mirror is the host's
        assert int(batch.req_pool_indices_cpu[0]) >= 0
        batch.to_forward_batch()  # building the launch reads mirrors only


def test_the_guard_is_off_the_schedule_path_and_on_other_threads(batch_ctx):
    ctx, batch = _decode_batch(batch_ctx)
    assert batch.seq_lens.tolist() == [4, 5]  # outside the schedule path: a plain read
    seen: list[list[int]] = []
    with ctx.monitor.schedule_path():
        # the stream's worker runs inside the schedule path too, unguarded: the mode is per thread
        ctx.stream.submit(lambda: seen.append(batch.seq_lens.tolist()))
        other = threading.Thread(target=lambda: seen.append(batch.seq_lens.tolist()))
        other.start()
        other.join()
    ctx.stream.synchronize()
    assert seen == [[4, 5], [4, 5]]


def test_host_read_is_the_sanctioned_read_outside_strict_mode(batch_ctx):
    ctx, batch = _decode_batch(batch_ctx, strict=False, cpu_mirrors=False)
    with ctx.monitor.schedule_path():
        assert ctx.monitor.host_read(batch.seq_lens, "schedule.page_count").tolist() == [4, 5]
        with pytest.raises(StrictReadError):
            batch.seq_lens.tolist()  # but not around it
    strict_ctx, strict_batch = _decode_batch(batch_ctx, strict=True)
    with strict_ctx.monitor.schedule_path(), pytest.raises(ScheduleSyncError, match="host_read"):
        strict_ctx.monitor.host_read(strict_batch.seq_lens, "schedule.page_count")


def test_the_parity_checker_is_a_sanctioned_debug_read(batch_ctx):
    ctx, batch = _decode_batch(batch_ctx)
    with ctx.monitor.schedule_path():
        batch.check_mirror_parity()


def test_production_path_has_no_guard(cpu_stream):
    stream = cpu_stream
    monitor = SyncMonitor(stream, strict=False)
    t = stream.upload(torch.arange(3))
    assert monitor.guard is None and stream.guard is None
    with monitor.schedule_path():
        assert t.tolist() == [0, 1, 2]


def test_the_registry_is_weak_and_survives_id_reuse():
    guard = StrictGuard()
    t = guard.register(torch.arange(3))
    assert guard.owns(t) and len(guard) == 1
    del t
    assert len(guard) == 0
    kept = [guard.register(torch.arange(2)) for _ in range(50)]
    fresh = [torch.arange(2) for _ in range(50)]  # may reuse ids of collected tensors
    assert all(guard.owns(k) for k in kept) and not any(guard.owns(f) for f in fresh)


def test_alloc_for_extend_results_the_guard_knows(batch_ctx):
    """The device/mirror identity contract, as the guard sees it (see test_mirror_parity)."""
    ctx, batch = _decode_batch(batch_ctx)
    guard = ctx.monitor.guard
    assert guard is not None
    assert guard.owns(batch.req_pool_indices) and guard.owns(batch.seq_lens)
    assert not guard.owns(batch.req_pool_indices_cpu) and not guard.owns(batch.seq_lens_cpu)


# ---------------------------------------------------------------------------- in the engine


async def test_a_schedule_path_read_in_the_engine_fails_its_batch_naming_the_site(
    llama, monkeypatch
):
    """A consumer that reads the device tensor instead of its mirror: strict mode names it."""

    def device_instead_of_mirror(self, site):
        return self.seq_lens  # .tolist() on it, in prepare_for_decode, is the read

    cfg = engine_config(llama, runtime={"strict": True})
    async with Engine(cfg) as engine:
        monkeypatch.setattr(ScheduleBatch, "host_seq_lens", device_instead_of_mirror)
        result = await engine.complete([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True})
        assert result.finish_reason == "error"
        assert "strict mode: .tolist()" in result.error
        assert "stallfree/runtime/" in result.error  # the consumer's line, named
        assert engine.healthy
        monkeypatch.undo()
        ok = await engine.complete([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True})
        assert ok.error is None and engine.core.monitor.guard.violations == 1


@pytest.mark.parametrize("mirrors", [True, False], ids=["mirrors", "legacy"])
async def test_the_guard_runs_in_every_mode_and_counts_what_it_knows(llama, mirrors):
    cfg = engine_config(llama, runtime={"cpu_mirrors": mirrors, "strict": mirrors})
    async with guarded(Engine(cfg)) as engine:
        guard = engine.core.monitor.guard
        assert guard is not None and guard.owns(engine.core.ctx.req_to_token_pool.req_to_token)
        await run_greedy(engine, random_prompts(3, seed=9), 6)
        assert guard.violations == 0
    if not mirrors:
        assert engine.core.monitor.total_stalls() > 0  # legacy read through host_read only


MODES = [
    pytest.param(True, True, id="overlap-mirrors"),
    pytest.param(True, False, id="overlap-legacy"),
    pytest.param(False, True, id="plain-mirrors"),
    pytest.param(False, False, id="plain-legacy"),
]


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_prefix_caching_under_the_guard_in_every_mode(llama, overlap, mirrors):
    """Shared prefixes (cache hits, cached slots uploaded into rows) under the read
    guard, strict where the mode allows it; outputs equal a run without the cache."""
    shared = random_prompts(1, seed=11, lo=40, hi=40)[0]
    prompts = [shared + tail for tail in random_prompts(6, seed=12, lo=2, hi=9)]
    stressed = {
        "cache": {"page_size": 4, "max_total_tokens": 192, "max_running_requests": 6},
        "scheduler": {"chunked_prefill_size": 16},
    }
    async with Engine(engine_config(llama, cache={"prefix_caching": False})) as engine:
        want = await run_greedy(engine, prompts, 16)
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    cfg = engine_config(llama, runtime=runtime, **stressed)
    cfg.cache.prefix_caching = True
    async with guarded(Engine(cfg)) as engine:
        first = await run_greedy(engine, prompts[:1], 16)  # warms the cache
        rest = await run_greedy(engine, prompts[1:], 16)
        await engine.wait_idle()
        counters = engine.snapshot().counters
        assert engine.core.monitor.guard.violations == 0
    assert first + rest == want
    assert counters.prefix_cache_hits > 0
