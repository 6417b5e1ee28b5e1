"""Greedy outputs equal transformers' greedy generate, token for token, in every mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallfree import Engine
from tests.engine_util import (
    MODES,
    engine_config,
    greedy_in_mode,
    random_prompts,
    run_greedy,
)
from tests.hf_models import hf_greedy, make_qwen2

NEW_TOKENS = 32
PROMPTS = random_prompts(8, seed=1)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_reference(request, tmp_path_factory):
    if request.param == "llama":
        path = Path(request.getfixturevalue("llama"))  # the suite's one tiny Llama
    else:
        path = make_qwen2(tmp_path_factory.mktemp(request.param))
    reference = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    return str(path), reference


WORKLOADS = {
    "roomy": {},
    # page_size > 1, prefill chunks of 7 tokens and a pool small enough to force retraction
    "stressed": {
        "cache": {"page_size": 4, "max_total_tokens": 192, "max_running_requests": 8},
        "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
    },
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_greedy_equals_transformers(model_and_reference, workload, overlap, mirrors):
    path, reference = model_and_reference
    # every mode under the read guard: legacy reads the device only through host_read
    run = await greedy_in_mode(path, PROMPTS, NEW_TOKENS, overlap, mirrors, **WORKLOADS[workload])
    outputs, stats, monitor = run.outputs, run.counters, run.monitor
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert got == want, f"prompt {i} (len {len(PROMPTS[i])}) diverged"
    if workload == "stressed":
        assert stats.retractions > 0
        assert stats.prompt_tokens == sum(len(p) for p in PROMPTS)  # each prompt counted once
        assert stats.prefill_tokens > stats.prompt_tokens  # retracted work recomputed
    if mirrors:
        assert monitor.schedule_path_reads == 0
        assert monitor.total_stalls() == 0
    else:
        assert monitor.stall_counts["schedule.page_count"] > 0
        if workload == "stressed":
            assert monitor.stall_counts["schedule.retract"] > 0


async def test_page_size_one_with_tiny_chunks(model_and_reference):
    path, reference = model_and_reference
    cfg = engine_config(
        path,
        runtime={"strict": True},
        cache={"page_size": 1},
        scheduler={"chunked_prefill_size": 3, "max_prefill_tokens": 5},
    )
    async with Engine(cfg) as engine:
        outputs = await run_greedy(engine, PROMPTS, NEW_TOKENS)
    assert outputs == reference


@pytest.mark.parametrize("overlap", [True, False])
async def test_decode_in_length_buckets_equals_transformers(
    model_and_reference, monkeypatch, overlap
):
    """Decode rows grouped by length, each group padded only to its own longest row (the
    torch path, which the native decode op replaces where it runs: kept on it here)."""
    from stallfree.runtime.model import attention

    groups_seen: list[int] = []
    plan = attention.plan_buckets

    def spy(lens, pad_ratio, merge_cost):
        groups = plan(lens, pad_ratio, merge_cost)
        groups_seen.append(len(groups))
        return groups

    monkeypatch.setattr(attention, "BUCKET_MERGE_ELEMS", 0)  # never merge: one call per bucket
    monkeypatch.setattr(attention, "plan_buckets", spy)
    monkeypatch.setattr(attention.PagedAttention, "takes_rope", False)  # RoPE and SDPA in torch
    path, reference = model_and_reference
    cfg = engine_config(path, runtime={"overlap": overlap, "strict": True})
    async with Engine(cfg) as engine:
        outputs = await run_greedy(engine, PROMPTS, NEW_TOKENS)
    assert outputs == reference
    assert max(groups_seen) > 1  # the prompts' lengths did split the batch


def test_length_buckets_bound_padding_and_cover_every_row():
    from stallfree.runtime.model.attention import plan_buckets

    lens = [5, 300, 7, 290, 40, 41, 42, 299, 6]
    groups = plan_buckets(lens, 1.15, merge_cost=0)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    padded = sum(len(g) * max(lens[i] for i in g) for g in groups)
    assert padded <= 1.15 * sum(lens)
    assert len(plan_buckets(lens, 1.15, merge_cost=10**9)) == 1  # cheap padding merges all
