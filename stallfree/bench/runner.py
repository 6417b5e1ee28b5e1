"""Run one workload against one target per mode: warm up, snapshot the counters, send requests
on their arrival schedule under the concurrency cap, snapshot again, summarize."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from stallfree.bench.counters import stall_figures
from stallfree.bench.http_targets import http_target
from stallfree.bench.launcher import ServerProcess
from stallfree.bench.results import RequestRecord, RunResult, median_result, summarize
from stallfree.bench.targets import InProcessTarget, RequestOptions, Target
from stallfree.bench.workloads import BenchRequest, arrival_offsets
from stallfree.config import StallfreeConfig

WARMUP_MAX_TOKENS = 16


@dataclass(slots=True)
class Mode:
    """A named set of engine settings that `--compare` runs side by side."""

    name: str
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)


BASE_MODES = (
    Mode("overlap off", {"runtime": {"overlap": False, "cpu_mirrors": False}}),
    Mode("overlap, mirrors off", {"runtime": {"overlap": True, "cpu_mirrors": False}}),
    Mode("overlap, mirrors on", {"runtime": {"overlap": True, "cpu_mirrors": True}}),
)
MODE_KEYS = {"off": 0, "no-mirrors": 1, "mirrors": 2}


def compare_modes(
    hisparse: str | None = None, keys: list[str] | None = None, prefix_caching: bool = False
) -> list[Mode]:
    """The base modes (or the `keys` subset), with HiSparse off, on, both, or as configured;
    with `prefix_caching`, each of them with the prefix cache off and then on."""
    base = [BASE_MODES[MODE_KEYS[k]] for k in keys] if keys else list(BASE_MODES)
    if prefix_caching:
        base = [
            Mode(
                f"{mode.name}, prefix cache {'on' if on else 'off'}",
                {**mode.settings, "cache": {"prefix_caching": on}},
            )
            for on in (False, True)
            for mode in base
        ]
    if hisparse is None:
        return base
    states = {"off": [False], "on": [True], "both": [False, True]}[hisparse]
    out = []
    for enabled in states:
        for mode in base:
            name = f"{mode.name}, hisparse" if enabled else mode.name
            settings = {**mode.settings, "hisparse": {"enabled": enabled}}
            out.append(Mode(name, settings))
    return out


def _merged(
    a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Settings `a` with `b`'s on top, section by section."""
    out = {section: dict(values) for section, values in a.items()}
    for section, values in b.items():
        out[section] = {**out.get(section, {}), **values}
    return out


CONFIGURED = "configured"


def worker_modes(
    modes: list[Mode],
    compare_workers: bool = False,
    tp_sizes: list[int] | None = None,
    set_worker: bool = True,
) -> list[Mode]:
    """`modes` run with the model in process and in worker processes (`compare_workers`), or
    at each tensor-parallel size of `tp_sizes` (in worker processes at every size, so that only
    the sharding differs, unless `set_worker` is False: the configured worker then). The
    variants go round the modes: every mode with the first, then every mode with the next."""
    variants: list[tuple[str, dict[str, dict[str, Any]]]] = []
    if compare_workers:
        variants = [
            ("worker inprocess", {"runtime": {"worker": "inprocess"}}),
            ("worker process", {"runtime": {"worker": "process"}}),
        ]
    elif tp_sizes:
        worker = {"runtime": {"worker": "process"}} if set_worker else {}
        variants = [(f"tp {n}", _merged(worker, {"parallel": {"tp_size": n}})) for n in tp_sizes]
    if not variants:
        return modes
    return [
        Mode(
            label if mode.name == CONFIGURED else f"{mode.name}, {label}",
            _merged(mode.settings, settings),
        )
        for label, settings in variants
        for mode in modes
    ]


@dataclass(slots=True)
class RunSettings:
    request_rate: float = math.inf
    max_concurrency: int | None = None
    warmup_requests: int = 2
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    burstiness: float = 1.0
    ramp_up: tuple[str, float, float] | None = None  # (strategy, start rps, end rps)


class ProgressSink(Protocol):
    def begin(self, name: str, total: int) -> None: ...

    def advance(self) -> None: ...

    def end(self) -> None: ...


TargetFactory = Callable[[Mode], AbstractAsyncContextManager[Target]]


def merge_settings(config: StallfreeConfig, mode: Mode) -> StallfreeConfig:
    merged = config.model_dump()
    for section, values in mode.settings.items():
        merged[section] = {**merged.get(section, {}), **values}
    return StallfreeConfig(**merged)


def inprocess_targets(base: StallfreeConfig) -> TargetFactory:
    @contextlib.asynccontextmanager
    async def open_target(mode: Mode) -> AsyncIterator[Target]:
        target = InProcessTarget(merge_settings(base, mode))
        await target.start()
        try:
            yield target
        finally:
            await target.stop()

    return open_target


def launched_http_targets(
    base: StallfreeConfig,
    config_path: str | None,
    startup_timeout_s: float,
    backend: str | None = None,
) -> TargetFactory:
    """A fresh `stallfree serve` per mode, sent every setting of the merged config so that
    nothing in the parent's environment can flip a mode."""

    @contextlib.asynccontextmanager
    async def open_target(mode: Mode) -> AsyncIterator[Target]:
        dumped = merge_settings(base, mode).model_dump(mode="json")
        dumped.pop("server", None)
        settings = {
            section: {k: v for k, v in values.items() if v is not None}
            for section, values in dumped.items()
        }
        server = ServerProcess(settings, config_path, startup_timeout_s)
        url = await server.start()
        # the server reads STALLFREE_SERVER__API_KEY from the environment it inherits
        target = http_target(backend, url, api_key=next(iter(base.server.api_keys), None))
        try:
            await target.start()
            yield target
        finally:
            await target.stop()
            await server.stop()

    return open_target


def url_targets(
    base_url: str, model: str | None, api_key: str | None, backend: str | None = None
) -> TargetFactory:
    @contextlib.asynccontextmanager
    async def open_target(mode: Mode) -> AsyncIterator[Target]:
        target = http_target(backend, base_url, model, api_key)
        await target.start()
        try:
            yield target
        finally:
            await target.stop()

    return open_target


async def _warm_up(target: Target, requests: list[BenchRequest], rs: RunSettings) -> None:
    if rs.warmup_requests <= 0:
        return
    opts = RequestOptions(rs.temperature, rs.ignore_eos, max_tokens=WARMUP_MAX_TOKENS)
    picked = [requests[i % len(requests)] for i in range(rs.warmup_requests)]
    await asyncio.gather(*(target.send(r, opts) for r in picked))


@dataclass(slots=True)
class _Flight:
    """Requests in flight at the target (past the concurrency gate), and the most seen."""

    now: int = 0
    peak: int = 0


async def _send_all(
    target: Target,
    requests: list[BenchRequest],
    rs: RunSettings,
    progress: ProgressSink | None,
) -> tuple[list[RequestRecord], float, int]:
    opts = RequestOptions(rs.temperature, rs.ignore_eos)
    gate = asyncio.Semaphore(rs.max_concurrency or len(requests))
    flight = _Flight()
    start = time.perf_counter()

    async def one(req: BenchRequest) -> RequestRecord:
        async with gate:
            flight.now += 1
            flight.peak = max(flight.peak, flight.now)
            sent = time.perf_counter() - start
            try:
                record = await target.send(req, opts)
            finally:
                flight.now -= 1
        record.start = sent
        if progress is not None:
            progress.advance()
        return record

    tasks = []
    for req, offset in zip(
        requests,
        arrival_offsets(len(requests), rs.request_rate, rs.seed, rs.burstiness, rs.ramp_up),
        strict=True,
    ):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start, flight.peak


async def run_mode(
    mode: Mode,
    open_target: TargetFactory,
    requests: list[BenchRequest],
    rs: RunSettings,
    progress: ProgressSink | None = None,
    label: str | None = None,
) -> RunResult:
    """One run of the workload on a fresh target; `label` names it on the progress bar."""
    started_at = time.time()
    async with open_target(mode) as target:
        await _warm_up(target, requests, rs)
        before = await target.counters()
        if progress is not None:
            progress.begin(label or mode.name, len(requests))
        try:
            records, duration, peak = await _send_all(target, requests, rs, progress)
        finally:
            if progress is not None:
                progress.end()
        after = await target.counters()
        described = target.describe()
    figures = stall_figures(before, after) if before and after else None
    errors = sorted({r.error for r in records if r.error})
    return RunResult(
        mode=mode.name,
        settings={"mode": asdict(mode), "target": described},
        summary=summarize(records, duration, peak),
        stallfree=figures,
        requests=records,
        errors=errors[:10],
        started_at=started_at,
        finished_at=time.time(),
    )


async def run_modes(
    modes: list[Mode],
    open_target: TargetFactory,
    requests: list[BenchRequest],
    rs: RunSettings,
    progress: ProgressSink | None = None,
    repeats: int = 1,
) -> list[RunResult]:
    """Modes one after another (never concurrently: they would share the same cores), the
    whole round `repeats` times, so that slow spells of the machine hit every mode alike.

    One result per mode. With one repeat it is the run itself; with more, each figure is the
    median over that mode's runs (`median_result`), which it keeps in `repeats`."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, not {repeats}")
    per_mode: list[list[RunResult]] = [[] for _ in modes]
    sequence = 0
    for repeat in range(1, repeats + 1):
        for mode, runs in zip(modes, per_mode, strict=True):
            label = mode.name if repeats == 1 else f"{mode.name} [{repeat}/{repeats}]"
            run = await run_mode(mode, open_target, requests, rs, progress, label)
            run.repeat, run.sequence = repeat, sequence
            sequence += 1
            runs.append(run)
    return [runs[0] if repeats == 1 else median_result(runs) for runs in per_mode]
