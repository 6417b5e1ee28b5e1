"""Mixed steps (`scheduler.enable_mixed_chunk`): the running decode rows ride along with a
prefill chunk in one step. Greedy outputs equal the engine's with mixing off, in every overlap x
mirrors mode; the decode rows advance while a long prompt is prefilled in chunks (counted per
launched step); every pool is back to full once the workload drains."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from stallfree import Engine, SamplingParams
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from tests.engine_util import MODES, engine_config, guarded, random_prompts

NEW_TOKENS = 40
SHORT = random_prompts(3, seed=5, lo=4, hi=10)
LONG = random_prompts(2, seed=6, lo=70, hi=90)  # several chunks each
SCHED = {"chunked_prefill_size": 16, "max_prefill_tokens": 24}


@dataclass
class Step:
    rids: list[str]
    extend_lens: list[int]
    mixed_rows: int


@dataclass
class MixedRun:
    outputs: list[list[int]]
    counters: Any  # EngineCounters
    steps: list[Step]


def record_steps(engine: Engine) -> list[Step]:
    """Every step the engine launches, as the host planned it."""
    steps: list[Step] = []
    runner = engine.core.runner
    launch = runner.launch

    def spy(step: Any, seq: int) -> Any:
        fb = step.forward_batch
        steps.append(Step([r.rid for r in step.reqs], list(fb.extend_lens_cpu), step.mixed_rows))
        return launch(step, seq)

    runner.launch = spy  # type: ignore[method-assign]
    return steps


async def run_workload(
    path: str,
    mixed: bool,
    overlap: bool,
    mirrors: bool,
    bad: bool = False,
    **sections: dict[str, Any],
) -> MixedRun:
    """Short prompts start decoding; once each has two tokens, the long prompts arrive (`bad`:
    and a prompt whose batch fails to build or launch, which must fail alone)."""
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    runtime |= sections.pop("runtime", {})
    scheduler = SCHED | {"enable_mixed_chunk": mixed} | sections.pop("scheduler", {})
    cfg = engine_config(path, runtime=runtime, scheduler=scheduler, **sections)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    async with guarded(Engine(cfg)) as engine:
        steps = record_steps(engine)
        decoding = [asyncio.Event() for _ in SHORT]

        async def stream(i: int, prompt: list[int]) -> list[int]:
            ids: list[int] = []
            async for chunk in engine.generate(prompt, params, rid=f"short{i}"):
                assert chunk.error is None, chunk.error
                ids.extend(chunk.token_ids)
                if len(ids) >= 2:
                    decoding[i].set()
            return ids

        shorts = [asyncio.create_task(stream(i, p)) for i, p in enumerate(SHORT)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in decoding)), 30)
        if bad:
            failed = await engine.complete(LONG[0], params, rid="bad")
            assert failed.error is not None and "could not run" in failed.error
        longs = await asyncio.gather(
            *(engine.complete(p, params, rid=f"long{i}") for i, p in enumerate(LONG))
        )
        for r in longs:
            assert r.error is None, r.error
        outputs = list(await asyncio.gather(*shorts)) + [r.token_ids for r in longs]
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        return MixedRun(outputs, engine.snapshot().counters, steps)


def chunk_steps(steps: list[Step]) -> list[Step]:
    """The steps that prefilled part of a long prompt."""
    return [
        s
        for s in steps
        if any(
            rid.startswith("long") and n > 1 for rid, n in zip(s.rids, s.extend_lens, strict=True)
        )
    ]


def decode_rows_of_shorts(step: Step) -> int:
    """Rows of the short requests in `step`: decode rows, one token each."""
    rows = [
        n for rid, n in zip(step.rids, step.extend_lens, strict=True) if rid.startswith("short")
    ]
    assert all(n == 1 for n in rows)
    return len(rows)


@pytest.fixture(scope="module")
def reference(llama):
    """The workload's outputs with mixing off (overlap, mirrors): every mode must give them."""
    run = asyncio.run(run_workload(llama, False, True, True))
    assert run.counters.mixed_batches == 0
    return run


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_mixed_equals_unmixed_and_decode_advances(llama, reference, overlap, mirrors):
    off = await run_workload(llama, False, overlap, mirrors)
    on = await run_workload(llama, True, overlap, mirrors)
    assert off.outputs == reference.outputs
    assert on.outputs == reference.outputs
    assert on.counters.mixed_batches > 0
    assert off.counters.mixed_batches == 0
    # the long prompts were prefilled over several steps (each longer than a chunk)
    on_chunks, off_chunks = chunk_steps(on.steps), chunk_steps(off.steps)
    assert len(on_chunks) >= 2 * len(LONG)
    assert len(off_chunks) >= 2 * len(LONG)
    # off: the decode rows wait while the prompts are prefilled; on: every chunk step carries
    # every short request's decode row (none finishes before the prompts are in)
    assert sum(decode_rows_of_shorts(s) for s in off_chunks) == 0
    for s in on_chunks:
        assert decode_rows_of_shorts(s) == len(SHORT)
        assert s.mixed_rows >= len(SHORT)
        assert sum(s.extend_lens) <= SCHED["max_prefill_tokens"]  # the decode rows count


async def test_mixed_with_retraction_and_pages(llama, reference):
    """Pages of 4 tokens and a pool small enough that decode rows are retracted while prompts
    are admitted; the mirrors and the future map are checked after every batch op."""
    run = await run_workload(
        llama,
        True,
        True,
        True,
        cache={"page_size": 4, "max_total_tokens": 200, "max_running_requests": 8},
        runtime={"check_mirrors": True},
    )
    assert run.outputs == reference.outputs
    assert run.counters.mixed_batches > 0
    assert run.counters.retractions > 0


async def test_mixing_off_with_speculation(llama):
    """Speculative decoding keeps today's steps: a verify step never carries a chunk."""
    run = await run_workload(
        llama, True, True, True, speculative={"method": "ngram", "num_speculative_tokens": 2}
    )
    assert run.counters.mixed_batches == 0
    assert all(s.mixed_rows == 0 for s in run.steps)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"runtime": {"worker": "process"}}, id="worker-process"),
        pytest.param({"parallel": {"tp_size": 2}}, id="tp2-gloo"),
    ],
)
async def test_mixed_in_worker_processes(llama, reference, layout):
    """The workers write a decode step's table entries themselves, not an extend step's: a
    mixed step sends its decode rows' entries with it."""
    run = await run_workload(llama, True, True, True, **layout)
    assert run.outputs == reference.outputs
    assert run.counters.mixed_batches > 0


async def _logprob_run(path: str, mixed: bool) -> tuple[list[Any], int]:
    """Every prompt at once with output and prompt logprobs and a repetition penalty: the short
    ones decode while the long ones are prefilled in chunks."""
    cfg = engine_config(
        path, runtime={"strict": True}, scheduler=SCHED | {"enable_mixed_chunk": mixed}
    )
    params = SamplingParams(
        max_new_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1, repetition_penalty=1.3
    )
    async with Engine(cfg) as engine:
        results = await asyncio.gather(*(engine.complete(p, params) for p in SHORT + LONG))
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        return list(results), engine.snapshot().counters.mixed_batches


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    same_top = [t for t, _ in a.top] == [t for t, _ in b.top]
    return a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4 and same_top


async def test_mixed_logprobs_and_penalties_equal_unmixed(llama):
    """A mixed step's logits processors and logprobs read each row at its own positions: the
    prompt chunks' prompt logprobs and the decode rows' output logprobs."""
    off, off_mixed = await _logprob_run(llama, False)
    on, on_mixed = await _logprob_run(llama, True)
    assert off_mixed == 0 and on_mixed > 0
    for a, b in zip(off, on, strict=True):
        assert a.error is None and b.error is None
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert all(_close(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        assert all(_close(x, y) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True))


def _poison_forward_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ScheduleBatch.to_forward_batch

    def to_forward_batch(self: ScheduleBatch) -> Any:
        if any(r.rid == "bad" for r in self.reqs):
            raise RuntimeError("poisoned launch")
        return original(self)

    monkeypatch.setattr(ScheduleBatch, "to_forward_batch", to_forward_batch)


def _poison_extend(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ScheduleBatch.prepare_for_extend

    def prepare_for_extend(self: ScheduleBatch, extend_lens: list[int]) -> None:
        original(self, extend_lens)  # its slot and pages are taken: they must come back
        if any(r.rid == "bad" for r in self.reqs):
            raise RuntimeError("poisoned extend")

    monkeypatch.setattr(ScheduleBatch, "prepare_for_extend", prepare_for_extend)


@pytest.mark.parametrize("poison", [_poison_forward_batch, _poison_extend])
@pytest.mark.parametrize("overlap", [True, False])
async def test_a_bad_prompt_in_a_mixed_step_fails_alone(
    llama, reference, monkeypatch, poison, overlap
):
    """Building or launching a mixed step raises because of its prompt: the prompt fails, the
    decode half (already prepared) runs alone, and the streams go on as if nothing happened."""
    poison(monkeypatch)
    run = await run_workload(llama, True, overlap, True, bad=True)
    assert run.outputs == reference.outputs
    assert run.counters.launch_failures == 1
    assert run.counters.mixed_batches > 0


async def test_a_bad_decode_row_in_a_mixed_step_fails_with_its_decode_batch(llama, monkeypatch):
    """The culprit is a decode row: the mixed step fails (its prompt rows with it), then the
    decode half alone fails too, as a decode step's failure does; nothing hangs, every pool
    comes back, and the engine serves on."""
    original = ScheduleBatch.to_forward_batch
    armed = []  # once short0 shares a step with a prompt, every step of short0's fails

    def to_forward_batch(self: ScheduleBatch) -> Any:
        rids = {r.rid for r in self.reqs}
        if "short0" in rids and (armed or any(rid.startswith("long") for rid in rids)):
            armed.append(True)
            raise RuntimeError("poisoned decode")
        return original(self)

    monkeypatch.setattr(ScheduleBatch, "to_forward_batch", to_forward_batch)
    cfg = engine_config(
        llama, runtime={"strict": True}, scheduler=SCHED | {"enable_mixed_chunk": True}
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    async with Engine(cfg) as engine:
        short = asyncio.create_task(engine.complete(SHORT[0], params, rid="short0"))
        while engine.snapshot().counters.generation_tokens < 3:
            await asyncio.sleep(0.001)
        longs = await asyncio.gather(
            *(engine.complete(p, params, rid=f"long{i}") for i, p in enumerate(LONG))
        )
        bad = await short
        assert bad.error is not None and "poisoned decode" in bad.error
        for r in longs:  # each failed with a step that carried the bad row, or ran to its end
            assert r.error is None or "poisoned decode" in r.error
        assert any(r.error is not None for r in longs)  # the mixed step's prompt failed with it
        counters = engine.snapshot().counters
        assert counters.launch_failures >= 2 and counters.mixed_batches > 0
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        again = await engine.complete(SHORT[1], params)
        assert again.error is None and len(again.token_ids) == NEW_TOKENS


async def test_mixed_rows_keep_their_lora_adapters(llama, tmp_path):
    """Prompt rows and decode rows under different adapters in one mixed step: each row's
    output equals transformers with its adapter merged."""
    from tests.lora.test_lora_engine import NAMES, lora_config
    from tests.lora_models import ADAPTERS, make_adapter, merged_greedy

    adapters = {
        name: str(make_adapter(llama, tmp_path / name, seed=i, **cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    cfg = lora_config(llama, adapters, scheduler=SCHED | {"enable_mixed_chunk": True})
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = SHORT + LONG
    async with Engine(cfg) as engine:
        results = await asyncio.gather(
            *(engine.complete(p, params, lora_name=NAMES[i % 4]) for i, p in enumerate(prompts))
        )
        await engine.wait_idle()
        assert engine.pool_usage().all_free and engine.lora.held() == 0
        assert engine.snapshot().counters.mixed_batches > 0
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        assert r.error is None, r.error
        want = merged_greedy(llama, adapters.get(NAMES[i % 4] or ""), p, 12)
        assert r.token_ids == want, f"prompt {i} under {NAMES[i % 4]} diverged"


async def _structured_run(path: str, mixed: bool) -> tuple[list[str], int]:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    cfg = engine_config(path, scheduler=SCHED | {"enable_mixed_chunk": mixed})
    constrained = [
        SamplingParams(
            max_new_tokens=60, temperature=1.0, seed=s, structured_outputs={"json": schema}
        )
        for s in range(len(SHORT))
    ]
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True)
    async with Engine(cfg) as engine:
        results = await asyncio.gather(
            *(engine.complete(p, c) for p, c in zip(SHORT, constrained, strict=True)),
            *(engine.complete(p, plain) for p in LONG),
        )
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        mixed_batches = engine.snapshot().counters.mixed_batches
    for r in results:
        assert r.error is None, r.error
    return [r.text for r in results], mixed_batches


async def test_mixed_rows_keep_their_grammars(llama):
    """Seeded constrained decode rows beside prompt chunks: the same replies as mixing off."""
    off, off_mixed = await _structured_run(llama, False)
    on, on_mixed = await _structured_run(llama, True)
    assert off_mixed == 0 and on_mixed > 0
    assert on == off
