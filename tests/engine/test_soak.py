"""Soak and chaos: thousands of requests, cancellations, deadlines, retraction, injected faults.

Seeded and bounded in time. It checks that no request is lost or duplicated, that every request
which was neither cancelled nor failed matches a fault-free run token for token, that every pool
is full after draining, and that the loop never stalls beyond a bound.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from stallfree import Engine
from tests.engine_util import engine_config, random_prompts
from tests.metrics_util import samples, value

pytestmark = pytest.mark.slow  # every test here is over ~5 s (see pyproject)

NUM_REQUESTS = 2000
REASONS = ("stop", "length", "abort", "error")
CONCURRENCY = 64


@dataclass
class Job:
    rid: str
    prompt: list[int]
    max_new: int
    cancel_after: float | None  # seconds; the client walks away mid-stream
    timeout: float | None


def make_jobs(seed: int, num_requests: int) -> list[Job]:
    rng = random.Random(seed)
    prompts = random_prompts(120, seed=seed, lo=3, hi=40)
    jobs = []
    for i in range(num_requests):
        roll = rng.random()
        jobs.append(
            Job(
                rid=f"soak-{i}",
                prompt=rng.choice(prompts),
                max_new=rng.randint(1, 12),
                cancel_after=rng.uniform(0.0, 0.02) if roll < 0.08 else None,
                timeout=0.001 if 0.08 <= roll < 0.10 else None,
            )
        )
    return jobs


async def reference(model: str, jobs: list[Job], hisparse: dict) -> dict[tuple, list[int]]:
    keys = sorted({(tuple(j.prompt), j.max_new) for j in jobs})
    # every key is submitted at once: more than the default waiting bound
    config = engine_config(
        model,
        runtime={"overlap": False},
        hisparse=hisparse,
        scheduler={"max_waiting_requests": len(keys)},
    )
    async with Engine(config) as engine:
        outs = await asyncio.gather(
            *(engine.complete(list(p), {"max_new_tokens": n, "ignore_eos": True}) for p, n in keys)
        )
    return {k: o.token_ids for k, o in zip(keys, outs, strict=True)}


async def run_job(
    engine: Engine, job: Job, gate: asyncio.Semaphore
) -> tuple[str, list[int], str | None]:
    async with gate:
        ids: list[int] = []
        finals = []

        async def consume() -> None:
            params = {"max_new_tokens": job.max_new, "ignore_eos": True}
            async for chunk in engine.generate(
                job.prompt, params, rid=job.rid, timeout=job.timeout
            ):
                ids.extend(chunk.token_ids)
                if chunk.finished:
                    finals.append(chunk.finish_reason)

        task = asyncio.create_task(consume())
        if job.cancel_after is not None:
            await asyncio.sleep(job.cancel_after)
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not finals:
                return job.rid, ids, "cancelled"
        assert len(finals) == 1, f"{job.rid} got {len(finals)} final chunks"
        return job.rid, ids, finals[0]


CHAOS = {
    "runtime": {"overlap": True, "cpu_mirrors": True, "max_consecutive_step_failures": 10_000},
    "cache": {"page_size": 2, "max_total_tokens": 320, "max_running_requests": 48},
    "scheduler": {"chunked_prefill_size": 16, "max_prefill_tokens": 64},
    "faults": {
        "enabled": True,
        "seed": 11,
        "fail_step_rate": 0.01,
        "fail_copy_rate": 0.005,
        "slow_step_rate": 0.02,
        "slow_step_seconds": 0.005,
    },
}


# top_k below most contexts and a small buffer, so selection, misses and eviction all happen
SPARSE = {"enabled": True, "top_k": 12, "device_buffer_size": 20}


@pytest.mark.parametrize(
    ("hisparse", "num_requests"), [({}, NUM_REQUESTS), (SPARSE, 1500)], ids=["dense", "hisparse"]
)
async def test_soak_with_chaos(llama, hisparse, num_requests):
    jobs = make_jobs(seed=21, num_requests=num_requests)
    ref = await reference(llama, jobs, hisparse)
    start = time.perf_counter()
    async with Engine(engine_config(llama, hisparse=hisparse, **CHAOS)) as engine:
        gate = asyncio.Semaphore(CONCURRENCY)
        results = await asyncio.gather(*(run_job(engine, j, gate) for j in jobs))
        await asyncio.wait_for(engine.wait_idle(), timeout=30)
        usage = engine.pool_usage()
        sparse_usage = engine.core.ctx.sparse.usage() if engine.core.ctx.sparse else None
        sparse_stats = engine.core.ctx.sparse.stats(sync=True) if engine.core.ctx.sparse else None
        snapshot = engine.snapshot()
        counters, stalls = snapshot.counters, snapshot.stalls
        schedule_path_reads = engine.core.monitor.schedule_path_reads
        injected = dict(engine.core.runner.faults.injected)
        scrape = samples(engine.metrics.render())
    wall = time.perf_counter() - start

    outcomes = Counter(reason for _, _, reason in results)
    assert len({rid for rid, _, _ in results}) == num_requests  # none lost, none duplicated
    assert sum(outcomes.values()) == num_requests
    by_rid = {j.rid: j for j in jobs}
    for rid, ids, reason in results:
        job = by_rid[rid]
        want = ref[(tuple(job.prompt), job.max_new)]
        if reason == "length":
            assert ids == want, rid
        else:  # cancelled, aborted by deadline, or failed: whatever arrived is a correct prefix
            assert ids == want[: len(ids)], rid
    assert usage.all_free, usage
    if sparse_usage is not None:
        assert sparse_usage.all_free, sparse_usage
        assert sparse_stats.misses > 0 and sparse_stats.hits > 0
    assert outcomes["length"] > num_requests * 0.6
    assert outcomes["error"] > 0 and outcomes["cancelled"] + outcomes["abort"] > 0
    assert counters.retractions > 0
    failures = {f.value: n for f, n in injected.items()}
    assert failures["fail_copy"] > 0
    assert counters.step_failures == failures["fail_step"] + failures["fail_copy"]
    # no iteration of the loop blocks on the device: it never read a device tensor, on the
    # schedule path or off it (every wait for a step is an await); the longest gap is printed
    assert (schedule_path_reads, stalls) == (0, {}), (schedule_path_reads, stalls)
    # the metrics agree with what the clients saw; a cancel can race a finish, so a client that
    # walked away may have been counted by the engine under the reason it finished with
    served = {
        r: value(scrape, "stallfree:request_success_total", finished_reason=r) for r in REASONS
    }
    assert sum(served.values()) == num_requests
    assert served["length"] >= outcomes["length"] and served["error"] >= outcomes["error"]
    assert served["abort"] <= outcomes["cancelled"] + outcomes["abort"]
    received = sum(len(ids) for _, ids, _ in results)
    assert value(scrape, "stallfree:generation_tokens_total") >= received
    print(
        f"\nsoak[{'hisparse' if hisparse else 'dense'}]: {num_requests} requests in {wall:.1f}s; outcomes {dict(outcomes)}; "
        f"faults { ({k.value: v for k, v in injected.items()}) }; retractions {counters.retractions}; "
        f"max loop gap {counters.max_iteration_gap * 1e3:.1f} ms"
    )
