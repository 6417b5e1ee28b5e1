"""HiSparse: config errors, equality with the dense model and with the oracle, LRU, no leaks."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pydantic
import pytest
import torch

from stallfree import Engine, SamplingParams
from stallfree.config import HisparseConfig
from stallfree.hisparse import (
    HisparseAttention,
    HisparseConfigError,
    HisparseCoordinator,
    TopkOracleAttention,
    topk_reference_row,
)
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.memory.pool import KVCacheShape
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.request.req import Req
from tests.engine_util import engine_config, guarded, random_prompts, run_greedy
from tests.hf_models import hf_greedy

NEW_TOKENS = 24
PROMPTS = random_prompts(6, seed=3)
LONG_PROMPTS = random_prompts(4, seed=4, lo=150, hi=200)
ROOMY = {"top_k": 512, "device_buffer_size": 512}  # >= every context here: all dense


@pytest.fixture(scope="module")
def reference(llama):
    return [hf_greedy(llama, p, NEW_TOKENS) for p in PROMPTS]


def _assert_drained(engine: Engine) -> None:
    assert engine.pool_usage().all_free
    usage = engine.core.ctx.sparse.usage()
    assert usage.all_free, usage
    assert engine.core.ctx.sparse.stats(sync=True).host_pool_used == 0


# ---------------------------------------------------------------------------- config


def test_buffer_smaller_than_top_k_is_a_validation_error():
    with pytest.raises(pydantic.ValidationError, match=r"device_buffer_size.*top_k"):
        HisparseConfig(top_k=32, device_buffer_size=16)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sparse_layers": [1, 5]}, r"sparse_layers has \[5\].*2 layers"),
        ({"sparse_layers": []}, r"sparse_layers is empty"),
        ({"sparse_layers": [1, 1]}, r"repeats"),
        ({"top_k": 4, "device_buffer_size": 8, "min_sparse_len": 9}, r"min_sparse_len \(9\)"),
    ],
)
def test_impossible_combinations_fail_at_construction(llama, settings, message):
    cfg = engine_config(llama, hisparse={"enabled": True, **settings})
    with pytest.raises(HisparseConfigError, match=message):
        Engine(cfg)


# ---------------------------------------------------------------------------- dense equality

MODES = [
    pytest.param(True, True, id="overlap-mirrors"),
    pytest.param(True, False, id="overlap-legacy"),
    pytest.param(False, True, id="plain-mirrors"),
    pytest.param(False, False, id="plain-legacy"),
]
STRESSED = {  # tiny prefill chunks and a pool small enough to force retraction
    "cache": {"page_size": 4, "max_total_tokens": 160, "max_running_requests": 8},
    "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
}


@pytest.mark.parametrize("stressed", [False, True], ids=["roomy", "stressed"])
@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_top_k_over_context_equals_dense(llama, reference, overlap, mirrors, stressed):
    cfg = engine_config(
        llama,
        runtime={"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors},
        hisparse={"enabled": True, **ROOMY},
        **(STRESSED if stressed else {}),
    )
    async with guarded(Engine(cfg)) as engine:  # the read guard in every mode
        outputs = await run_greedy(engine, PROMPTS, NEW_TOKENS)
        await engine.wait_idle()
        _assert_drained(engine)
        monitor, stats = engine.core.monitor, engine.snapshot().counters
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert got == want, f"prompt {i} (len {len(PROMPTS[i])}) diverged"
    if stressed:
        assert stats.retractions > 0
    if mirrors:
        assert monitor.schedule_path_reads == 0
        assert monitor.total_stalls() == 0
    else:
        assert monitor.stall_counts["hisparse.map_last_loc"] == stats.decode_batches > 0


async def test_dense_engine_matches_reference_too(llama, reference):
    """The HF reference above is also what the dense engine produces."""
    async with Engine(engine_config(llama)) as engine:
        assert await run_greedy(engine, PROMPTS, NEW_TOKENS) == reference


# ---------------------------------------------------------------------------- oracle equality


class CheckedHisparse(HisparseAttention):
    """Compares every sparse decode output with the oracle computed from the host pool."""

    def __init__(self, inner: HisparseAttention) -> None:
        super().__init__(inner.coordinator, inner.dense)
        self.max_err = 0.0
        self.checked = 0

    def _decode(self, q, k, v, li, layer_id, fb):
        out = super()._decode(q, k, v, li, layer_id, fb)
        co, plan = self.coordinator, fb.sparse_plan
        host_k, host_v = co.host.k[li], co.host.v[li]
        for i, (row, n) in enumerate(zip(plan.rows, plan.n_prev, strict=True)):
            hist = fb.req_to_token[row, :n]
            res = plan.reserved[i]
            want = topk_reference_row(
                q[i],
                host_k[hist],
                host_v[hist],
                co.buffers.k[li][res],
                co.buffers.v[li][res],
                co.top_k,
                co.min_sparse_len,
            )
            self.max_err = max(self.max_err, float((out[i] - want).abs().max()))
            self.checked += 1
        return out


async def _run_checked(path, prompts, hisparse, **sections):
    cfg = engine_config(path, hisparse={"enabled": True, **hisparse}, **sections)
    async with guarded(Engine(cfg)) as engine:
        model = engine.core.loaded.model
        checker = model.attn_backend = CheckedHisparse(model.attn_backend)
        outputs = await run_greedy(engine, prompts, NEW_TOKENS)
        await engine.wait_idle()
        _assert_drained(engine)
        stats = engine.core.ctx.sparse.stats(sync=True)
    return outputs, checker, stats


async def _run_oracle(path, prompts, top_k, min_sparse_len, sparse_layers):
    async with Engine(engine_config(path)) as engine:
        model = engine.core.loaded.model
        model.attn_backend = TopkOracleAttention(
            top_k, min_sparse_len, sparse_layers, model.attn_backend
        )
        return await run_greedy(engine, prompts, NEW_TOKENS)


@pytest.mark.parametrize(("overlap", "mirrors"), [MODES[0], MODES[3]])
async def test_small_top_k_equals_oracle(llama, overlap, mirrors):
    hisparse = {"top_k": 16, "device_buffer_size": 32}
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    outputs, checker, stats = await _run_checked(llama, LONG_PROMPTS, hisparse, runtime=runtime)
    oracle = await _run_oracle(llama, LONG_PROMPTS, 16, 0, [1])
    async with Engine(engine_config(llama)) as engine:
        dense = await run_greedy(engine, LONG_PROMPTS, NEW_TOKENS)
    assert oracle != dense  # the top-k restriction changes the outputs
    assert checker.checked >= len(LONG_PROMPTS) * (NEW_TOKENS - 1)
    assert checker.max_err < 1e-5
    assert outputs == oracle
    assert stats.misses > 0 and stats.hits > 0  # the small buffer forced LRU eviction


async def test_every_layer_sparse_with_chunks_and_min_len_matches_step_oracle(llama):
    prompts = [*LONG_PROMPTS[:2], *PROMPTS[:3]]  # short ones stay under min_sparse_len
    hisparse = {"top_k": 8, "device_buffer_size": 24, "sparse_layers": [0, 1]}
    hisparse["min_sparse_len"] = 20
    _, checker, stats = await _run_checked(
        llama, prompts, hisparse, scheduler={"chunked_prefill_size": 37}
    )
    assert checker.checked > 0 and checker.max_err < 1e-5
    assert stats.misses > 0


# ---------------------------------------------------------------------------- unit: coordinator


@dataclass
class Harness:
    co: HisparseCoordinator
    ctx: BatchContext
    reqs: dict[int, Req] = field(default_factory=dict)

    def table(self) -> torch.Tensor:
        return self.ctx.req_to_token_pool.req_to_token

    def prefill(self, row: int, prompt_len: int) -> None:
        """Prompt KV on host (value = position + 1 + 100*layer), then admission."""
        req = Req(f"r{row}", [1] * prompt_len, SamplingParams(max_new_tokens=8))
        req.req_pool_idx = row
        self.reqs[row] = req
        slots = self._slots(row, 0, prompt_len)
        for li in range(len(self.co.sparse_layers)):
            value = torch.arange(1, prompt_len + 1, dtype=torch.float32) + 100 * li
            self.co.host.k[li][slots] = value[:, None, None]
            self.co.host.v[li][slots] = -value[:, None, None]
        plan = self.co.plan_step(ForwardMode.EXTEND, [req], [0], [prompt_len], [True])
        for li in range(len(self.co.sparse_layers)):
            self.co.admit_on_stream(li, plan)

    def _slots(self, row: int, start: int, end: int) -> torch.Tensor:
        slots = torch.arange(start, end) + 1 + row * 64
        self.table()[row, start:end] = slots
        return slots

    def decode(
        self, rows: list[int], lens: list[int], value: float, schedule_path: bool = False
    ) -> None:
        """One decode step: map, then write `value` as the new token's KV (what the model does).

        `schedule_path`: the map runs there, on stream-owned device tensors, as in the engine.
        """
        for row, length in zip(rows, lens, strict=True):
            self._slots(row, length - 1, length)
        t, up = torch.tensor, self.ctx.stream.upload
        with self.ctx.monitor.schedule_path() if schedule_path else contextlib.nullcontext():
            self.co.map_last_loc_to_buffer(up(t(lens)), up(t([0])), up(t(rows)), t(lens), t(rows))
            plan = self.co.plan_step(ForwardMode.DECODE, [], [], [], [])
        self.ctx.stream.synchronize()
        locs = self.table()[t(rows), t(lens) - 1]
        shape = (len(rows), *self.co.host.k[0].shape[1:])
        for li in range(len(self.co.sparse_layers)):
            kv = torch.full(shape, value + 100 * li)
            self.co.write_decode(li, plan, locs, kv, -kv)


@pytest.fixture
def harness(batch_ctx) -> Callable[..., Harness]:
    """A coordinator on a model-free context: 4 request rows of 64 tokens, 256 KV slots, KV
    [layers, 1 head, dim 2], strict; its stream is closed after the test."""

    def build(top_k: int, buffer: int, layers: int = 1) -> Harness:
        ctx = batch_ctx(
            num_tokens=255,
            num_reqs=4,
            max_context=64,
            strict=True,
            check_mirrors=False,
            kv_shape=KVCacheShape(layers, 1, 2),
        )
        cfg = HisparseConfig(enabled=True, top_k=top_k, device_buffer_size=buffer)
        return Harness(HisparseCoordinator(cfg, list(range(layers)), ctx), ctx)

    return build


def _resident(h: Harness, li: int, row: int, pos: int) -> float | None:
    slot = int(h.co.buffers.pos_to_buf[li][row, pos])
    if slot < 0:
        return None
    return float(h.co.buffers.k[li][row * h.co.buffers.stride + slot, 0, 0])


def test_lru_second_step_moves_exactly_the_misses(harness):
    h = harness(top_k=2, buffer=4)
    h.prefill(0, 10)  # buffer holds positions 6..9 in slots 0..3
    assert [_resident(h, 0, 0, p) for p in (6, 9)] == [7.0, 10.0]
    token = h.co.token_bytes
    before = h.co.stats(sync=True)
    slots = h.co.swap_in_selected(torch.tensor([0]), [10], torch.tensor([[1, 2]]), 0, 1)
    assert slots.tolist() == [[0, 1]]  # both misses take the least recently used slots
    after1 = h.co.stats(sync=True)
    assert (after1.hits - before.hits, after1.misses - before.misses) == (0, 2)
    assert after1.bytes_h2d - before.bytes_h2d == 2 * token
    assert _resident(h, 0, 0, 6) is None and _resident(h, 0, 0, 1) == 2.0
    # half hits, half misses: position 2 is resident, 3 evicts the LRU slot (2, position 8)
    slots = h.co.swap_in_selected(torch.tensor([0]), [10], torch.tensor([[2, 3]]), 0, 2)
    assert slots.tolist() == [[1, 2]]
    after2 = h.co.stats(sync=True)
    assert (after2.hits - after1.hits, after2.misses - after1.misses) == (1, 1)
    assert after2.bytes_h2d - after1.bytes_h2d == token
    assert _resident(h, 0, 0, 8) is None and _resident(h, 0, 0, 3) == 4.0
    # next eviction: slot 3 (position 9, never used) before slot 0 (used at step 1)
    slots = h.co.swap_in_selected(torch.tensor([0]), [10], torch.tensor([[4, 5]]), 0, 3)
    assert slots.tolist() == [[3, 0]]


def test_lru_order_is_per_layer(harness):
    h = harness(top_k=1, buffer=2, layers=2)
    h.prefill(0, 6)  # both layers: positions 4, 5 in slots 0, 1
    h.co.swap_in_selected(torch.tensor([0]), [6], torch.tensor([[4]]), 0, 1)  # layer 0 uses slot 0
    h.co.swap_in_selected(torch.tensor([0]), [6], torch.tensor([[5]]), 1, 1)  # layer 1 uses slot 1
    h.co.swap_in_selected(torch.tensor([0]), [6], torch.tensor([[0]]), 0, 2)
    h.co.swap_in_selected(torch.tensor([0]), [6], torch.tensor([[0]]), 1, 2)
    assert _resident(h, 0, 0, 5) is None and _resident(h, 0, 0, 4) == 5.0
    assert _resident(h, 1, 0, 4) is None and _resident(h, 1, 0, 5) == 106.0
    assert _resident(h, 0, 0, 0) == 1.0 and _resident(h, 1, 0, 0) == 101.0


def test_fast_path_counts_hits_and_moves_nothing(harness):
    h = harness(top_k=2, buffer=8)
    h.prefill(0, 6)
    before = h.co.stats(sync=True)
    slots = h.co.swap_in_selected(torch.tensor([0]), [6], torch.tensor([[0, 5]]), 0, 1)
    after = h.co.stats(sync=True)
    assert slots.tolist() == [[0, 5]]
    assert (after.hits - before.hits, after.misses, after.bytes_h2d) == (2, 0, before.bytes_h2d)


def test_buffer_grows_and_backup_lands_in_host_slot(harness):
    h = harness(top_k=2, buffer=4, layers=2)
    h.prefill(1, 2)
    assert h.co.usage().buffer_slots_used == 2 and h.co.usage().host_slots_used == 2
    for step, length in enumerate(range(3, 9)):
        h.decode([1], [length], value=1000.0 + length)
        usage = h.co.usage()
        # the previous token is backed up (and kept while the buffer has room) at the next step
        assert usage.host_slots_used == length - 1, step
        assert usage.buffer_slots_used == min(length - 1, 4), step
    h.ctx.stream.synchronize()
    slots = h.table()[1, :7]
    for li in range(2):
        backed = h.co.host.k[li][slots, 0, 0].tolist()
        assert backed[2:] == [1000.0 + n + 100 * li for n in range(3, 8)]
        assert h.co.host.v[li][slots[6], 0, 0] == -(1007.0 + 100 * li)
        # grown slots 2, 3 hold positions 2, 3; position 4 onwards lives on the host only
        assert [_resident(h, li, 1, p) for p in (2, 3, 4)] == [
            1003.0 + 100 * li,
            1004.0 + 100 * li,
            None,
        ]
    h.co.request_finished(h.reqs[1])
    assert h.co.usage().all_free


def test_map_last_loc_reads_no_device_tensor_with_mirrors(harness):
    h = harness(top_k=2, buffer=4)
    h.prefill(0, 3)
    h.decode([0], [4], 1.0, schedule_path=True)  # strict: any device read there raises
    h.decode([0], [5], 2.0, schedule_path=True)
    assert h.ctx.monitor.schedule_path_reads == 0
    assert h.ctx.monitor.guard is not None and h.ctx.monitor.guard.violations == 0


# ---------------------------------------------------------------------------- no leaks


async def test_no_leaks_after_retraction_and_cancel(llama):
    cfg = engine_config(
        llama,
        hisparse={"enabled": True, "top_k": 8, "device_buffer_size": 16},
        runtime={"strict": True},
        **STRESSED,
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, 45))] for _ in range(8)]
    async with Engine(cfg) as engine:

        async def cancelled() -> None:
            params = SamplingParams(max_new_tokens=100, ignore_eos=True)
            async for chunk in engine.generate(prompts[0], params):
                if chunk.token_ids:
                    break  # leaving the stream aborts the request

        await asyncio.gather(cancelled(), run_greedy(engine, prompts[1:], NEW_TOKENS))
        await engine.wait_idle()
        assert engine.snapshot().counters.retractions > 0
        _assert_drained(engine)
        stats = engine.core.ctx.sparse.stats(sync=True)
    assert stats.misses > 0 and stats.bytes_d2h > 0 and stats.host_pool_total > 0


# ---------------------------------------------------------------------------- scheduling


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_retracted_requests_match_their_solo_runs(llama, overlap):
    """A retracted request is re-prefilled with its outputs (here in chunks, into another slot).

    Those output positions must attend as their decode steps did (top-k, not dense), or the
    tokens sampled after the re-prefill differ from the same request run alone.
    """
    hisparse = {"enabled": True, "top_k": 4, "device_buffer_size": 8}
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(14, 30))] for _ in range(8)]
    async with Engine(engine_config(llama, hisparse=hisparse)) as engine:
        alone = [(await run_greedy(engine, [p], NEW_TOKENS))[0] for p in prompts]
    cfg = engine_config(
        llama, hisparse=hisparse, runtime={"overlap": overlap, "strict": True}, **STRESSED
    )
    async with Engine(cfg) as engine:
        crowd = await run_greedy(engine, prompts, NEW_TOKENS)
        await engine.wait_idle()
        _assert_drained(engine)
        assert engine.snapshot().counters.retractions > 0
    for i, (got, want) in enumerate(zip(crowd, alone, strict=True)):
        assert got == want, f"prompt {i} (len {len(prompts[i])}) diverged from its solo run"


async def test_host_to_device_ratio_sizes_the_host_pool(llama):
    sizes = {}
    for ratio in (1.0, 2.5):
        cfg = engine_config(
            llama,
            cache={"max_total_tokens": 400},
            hisparse={
                "enabled": True,
                "top_k": 8,
                "device_buffer_size": 16,
                "host_to_device_ratio": ratio,
            },
        )
        async with Engine(cfg) as engine:
            sizes[ratio] = (
                engine.core.ctx.allocator.size,
                engine.core.ctx.sparse.usage().host_slots_total,
            )
    assert sizes[1.0] == (400, 400)
    assert sizes[2.5] == (1000, 1000)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_oracle_under_retraction_matches_solo_oracle_and_hisparse(llama, overlap):
    """The oracle's re-prefill attends at output positions as decode did, like HiSparse."""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(14, 30))] for _ in range(8)]
    solo = [(await _run_oracle(llama, [p], 4, 0, [1]))[0] for p in prompts]
    runtime = {"overlap": overlap}
    async with Engine(engine_config(llama, runtime=runtime, **STRESSED)) as engine:
        model = engine.core.loaded.model
        model.attn_backend = TopkOracleAttention(4, 0, [1], model.attn_backend)
        crowd = await run_greedy(engine, prompts, NEW_TOKENS)
        assert engine.snapshot().counters.retractions > 0
    assert crowd == solo
    hisparse = {"enabled": True, "top_k": 4, "device_buffer_size": 8}
    async with Engine(
        engine_config(llama, hisparse=hisparse, runtime=runtime, **STRESSED)
    ) as engine:
        assert await run_greedy(engine, prompts, NEW_TOKENS) == solo
