"""Helpers to run a concurrent workload through an Engine."""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from stallfree import Engine, SamplingParams, load_config

# (overlap, cpu_mirrors): every mode the runtime must agree across
MODES = [
    pytest.param(True, True, id="overlap-mirrors"),
    pytest.param(True, False, id="overlap-legacy"),
    pytest.param(False, True, id="plain-mirrors"),
    pytest.param(False, False, id="plain-legacy"),
]


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_config(model_path: str, **sections: dict[str, Any]):
    # float32 and dense unless a test asks otherwise: the equality tests compare with
    # transformers in float32 exactly, where `auto` would pick bfloat16 on a CPU that has it
    # and keep a GGUF file's blocks packed
    base: dict[str, dict[str, Any]] = {
        "model": {"path": model_path, "dtype": "float32", "quantization": "none"},
        "runtime": {"device": "cpu"},
        "cache": {},
        "scheduler": {},
    }
    for key, values in sections.items():
        base.setdefault(key, {}).update(values)
    return load_config(**base)


def guarded(engine: Engine) -> Engine:
    """Strict mode's read guard on `engine` in any mode, legacy included (before it starts):
    a device read on the schedule path that bypasses `host_read` raises."""
    engine.core.runner.enable_read_guard()
    return engine


async def run_greedy(
    engine: Engine, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
    for r in results:
        assert r.error is None, r.error
    return [r.token_ids for r in results]


@dataclass
class GreedyRun:
    outputs: list[list[int]]
    counters: Any  # EngineCounters
    monitor: Any  # the engine's SyncMonitor


async def greedy_in_mode(
    model_path: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    overlap: bool,
    mirrors: bool,
    **sections: dict[str, Any],
) -> GreedyRun:
    """Greedy outputs of `prompts` on an engine in one overlap x mirrors mode (strict with
    mirrors), every mode under the read guard; every pool is back to full once it drains."""
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    cfg = engine_config(model_path, runtime=runtime | sections.pop("runtime", {}), **sections)
    async with guarded(Engine(cfg)) as engine:
        outputs = await run_greedy(engine, prompts, max_new_tokens)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        return GreedyRun(outputs, engine.snapshot().counters, engine.core.monitor)


async def settle(engine: Engine, timeout: float = 10) -> None:
    """Wait until `engine` is idle; then no request holds a slot or a KV token."""
    await asyncio.wait_for(engine.wait_idle(), timeout)
    assert engine.pool_usage().all_free


def calls_made(fn: Callable[[], Any]) -> int:
    """How many Python and builtin functions `fn()` calls on this thread: a cost that does not
    depend on the machine's speed (a loop over n items costs about n calls or more)."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return count
