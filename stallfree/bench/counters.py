"""Stall, overlap and speculative-decoding counters of a stallfree target: snapshots before and
after a run, from the embedded engine or from `/metrics`, and the figures their difference gives."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from stallfree.runtime.engine import Engine

PREFIX = "stallfree:"


@dataclass(slots=True)
class RankCounters:
    """A worker rank's cumulative counters (`WorkerRankStats`)."""

    steps: float
    step_seconds: float
    comm_seconds: float  # in tensor-parallel collectives: all-reduce and all-gather
    comm_bytes: float
    message_bytes: float  # step messages the scheduler sent it (rank 0 only)


@dataclass(slots=True)
class RankFigures:
    """What one worker rank did during a run."""

    steps: float | None = None
    mean_step_seconds: float | None = None
    comm_seconds: float | None = None  # collectives (all-reduce, all-gather)
    comm_share: float | None = None  # collective seconds / step seconds
    comm_bytes_per_step: float | None = None
    # the scheduler's step messages, bytes per step (rank 0 receives them; 0 on the others)
    message_bytes_per_step: float | None = None


@dataclass(slots=True)
class SpecCounters:
    """Speculative decoding's cumulative counters (`SpecStats`): verify rows that carried
    drafts, their draft tokens, those accepted, accepted by draft position (0 is the first),
    and requests that stopped proposing."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_pos: list[float]
    requests_disabled: float


@dataclass(slots=True)
class SpecFigures:
    """What speculative decoding did during a run, as vLLM defines its figures. The ratios are
    None when nothing was drafted (there is nothing to accept)."""

    num_drafts: float | None = None
    num_draft_tokens: float | None = None
    num_accepted_tokens: float | None = None
    acceptance_rate: float | None = None  # accepted / draft tokens
    mean_acceptance_length: float | None = None  # 1 + accepted / drafts: tokens per verify row
    # accepted at each draft position / drafts, keyed by the position ("0" is the first)
    acceptance_rate_per_pos: dict[str, float] | None = None
    requests_disabled: float | None = None


@dataclass(slots=True)
class CounterSnapshot:
    """Cumulative counters at one moment; None where the target does not expose one."""

    wall: float
    steps: float | None = None
    overlap_steps: float | None = None
    stalls: dict[str, float] | None = None
    stall_seconds: dict[str, float] | None = None
    busy_seconds: float | None = None
    idle_seconds: float | None = None
    schedule_sum: float | None = None
    schedule_count: float | None = None
    prefix_queries: float | None = None  # prefix cache lookups, tokens
    prefix_hits: float | None = None
    workers: dict[str, RankCounters] | None = None  # by rank; None: the model runs in process
    spec: SpecCounters | None = None  # None: speculation off, or not a stallfree target


@dataclass(slots=True)
class StallFigures:
    """What a run cost in stalls and overlap; None = the target does not report it."""

    steps: float | None = None
    overlap_steps: float | None = None
    stalls_total: float | None = None
    stalls_per_step: dict[str, float] | None = None
    stall_seconds: float | None = None
    stall_seconds_by_site: dict[str, float] | None = None
    device_busy_seconds: float | None = None
    device_idle_seconds: float | None = None
    device_idle_fraction: float | None = None
    mean_schedule_seconds: float | None = None
    # cached tokens / tokens looked up at admission; None without a prefix cache
    prefix_cache_hit_rate: float | None = None
    sites: list[str] = field(default_factory=list)
    # per worker rank, keyed by the rank; None without worker processes
    workers: dict[str, RankFigures] | None = None
    spec: SpecFigures | None = None  # None with speculation off


def snapshot_engine(engine: Engine) -> CounterSnapshot:
    """Read the embedded engine's own counters (no Prometheus round trip)."""
    snap = engine.snapshot()
    c = snap.counters
    return CounterSnapshot(
        wall=time.perf_counter(),
        steps=float(c.steps),
        overlap_steps=float(c.overlap_steps),
        stalls={k: float(v) for k, v in snap.stalls.items()},
        stall_seconds=dict(snap.stall_seconds),
        busy_seconds=snap.device_busy_seconds,
        idle_seconds=snap.device_idle_seconds,
        schedule_sum=c.schedule_seconds,
        schedule_count=float(c.steps),
        prefix_queries=float(c.prefix_cache_queries),
        prefix_hits=float(c.prefix_cache_hits),
        workers={
            str(w.rank): RankCounters(
                steps=float(w.steps),
                step_seconds=w.step_seconds,
                comm_seconds=w.comm_seconds,
                comm_bytes=float(w.comm_bytes),
                message_bytes=float(w.message_bytes),
            )
            for w in snap.workers
        }
        or None,
        spec=None
        if snap.spec is None
        else SpecCounters(
            num_drafts=float(snap.spec.num_drafts),
            num_draft_tokens=float(snap.spec.num_draft_tokens),
            num_accepted_tokens=float(snap.spec.num_accepted_tokens),
            accepted_per_pos=[float(n) for n in snap.spec.accepted_per_pos],
            requests_disabled=float(snap.spec.requests_disabled),
        ),
    )


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX):
            continue
        out.setdefault(family.name, [])
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    rows = samples.get(name)
    return None if rows is None else sum(v for _, v in rows)


def _by_label(
    samples: dict[str, list[tuple[dict[str, str], float]]], family: str, name: str, label: str
) -> dict[str, float] | None:
    if family not in samples:
        return None
    out: dict[str, float] = {}
    for labels, value in samples.get(name, []):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def snapshot_prometheus(text: str) -> CounterSnapshot | None:
    """Parse a `/metrics` page; None when it carries no stallfree metrics at all."""
    s = _samples(text)
    if not s:
        return None
    p = PREFIX
    return CounterSnapshot(
        wall=time.perf_counter(),
        steps=_total(s, p + "steps_total"),
        overlap_steps=_total(s, p + "overlap_steps_total"),
        stalls=_by_label(s, p + "sync_stalls", p + "sync_stalls_total", "site"),
        stall_seconds=_by_label(s, p + "sync_stall_seconds", p + "sync_stall_seconds_sum", "site"),
        busy_seconds=_total(s, p + "device_busy_seconds_total"),
        idle_seconds=_total(s, p + "device_idle_seconds_total"),
        schedule_sum=_total(s, p + "schedule_seconds_sum"),
        schedule_count=_total(s, p + "schedule_seconds_count"),
        prefix_queries=_total(s, p + "prefix_cache_queries_total"),
        prefix_hits=_total(s, p + "prefix_cache_hits_total"),
        workers=_workers(s),
        spec=_spec(s),
    )


def _spec(s: dict[str, list[tuple[dict[str, str], float]]]) -> SpecCounters | None:
    """The speculative-decoding counters, or None with speculation off: its per-position family
    then has no series (no draft position), though the other counters are there at 0."""
    p = PREFIX + "spec_decode_"
    per_pos = _by_label(
        s, p + "num_accepted_tokens_per_pos", p + "num_accepted_tokens_per_pos_total", "position"
    )
    positions = [int(k) for k in per_pos or {} if k.isdigit()]
    if not positions:
        return None
    return SpecCounters(
        num_drafts=_total(s, p + "num_drafts_total") or 0.0,
        num_draft_tokens=_total(s, p + "num_draft_tokens_total") or 0.0,
        num_accepted_tokens=_total(s, p + "num_accepted_tokens_total") or 0.0,
        accepted_per_pos=[(per_pos or {}).get(str(i), 0.0) for i in range(max(positions) + 1)],
        requests_disabled=_total(s, p + "requests_disabled_total") or 0.0,
    )


def _workers(
    s: dict[str, list[tuple[dict[str, str], float]]],
) -> dict[str, RankCounters] | None:
    """Per-rank figures from the worker families (present only with worker processes)."""
    p = PREFIX

    def by_rank(name: str) -> dict[str, float]:
        return _by_label(s, p + name, p + name + "_total", "rank") or {}

    steps = by_rank("worker_steps")
    if not steps:
        return None
    seconds, comm, comm_bytes = (
        by_rank(n) for n in ("worker_step_seconds", "tp_collective_seconds", "tp_collective_bytes")
    )
    sent = _total(s, p + "worker_message_bytes_total") or 0.0
    return {
        rank: RankCounters(
            steps=n,
            step_seconds=seconds.get(rank, 0.0),
            comm_seconds=comm.get(rank, 0.0),
            comm_bytes=comm_bytes.get(rank, 0.0),
            message_bytes=sent if rank == "0" else 0.0,
        )
        for rank, n in steps.items()
    }


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _delta_map(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, float] | None:
    if a is None or b is None:
        return None
    return {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0) > 0}


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def rank_figures(
    before: dict[str, RankCounters] | None, after: dict[str, RankCounters] | None
) -> dict[str, RankFigures] | None:
    """Per rank: steps, mean step time, collective time and its share of the step time, and
    bytes per step (collectives; the scheduler's step messages)."""
    if before is None or after is None:
        return None
    out = {}
    for rank, b in sorted(after.items(), key=lambda kv: int(kv[0])):
        a = before.get(rank)
        if a is None:
            continue
        steps = b.steps - a.steps
        seconds = b.step_seconds - a.step_seconds
        comm = b.comm_seconds - a.comm_seconds
        out[rank] = RankFigures(
            steps=steps,
            mean_step_seconds=_ratio(seconds, steps),
            comm_seconds=comm,
            comm_share=_ratio(comm, seconds),
            comm_bytes_per_step=_ratio(b.comm_bytes - a.comm_bytes, steps),
            message_bytes_per_step=_ratio(b.message_bytes - a.message_bytes, steps),
        )
    return out or None


def spec_figures(before: SpecCounters | None, after: SpecCounters | None) -> SpecFigures | None:
    """Draft and accepted tokens over a run, the acceptance rate (accepted / draft tokens), the
    mean acceptance length (1 + accepted / drafts) and the acceptance rate by position."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    earlier = before.accepted_per_pos
    per_pos = [
        n - (earlier[i] if i < len(earlier) else 0.0) for i, n in enumerate(after.accepted_per_pos)
    ]
    return SpecFigures(
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted,
        acceptance_rate=_ratio(accepted, draft_tokens),
        mean_acceptance_length=None if not drafts else 1.0 + accepted / drafts,
        acceptance_rate_per_pos={str(i): n / drafts for i, n in enumerate(per_pos)}
        if drafts
        else None,
        requests_disabled=after.requests_disabled - before.requests_disabled,
    )


def stall_figures(before: CounterSnapshot, after: CounterSnapshot) -> StallFigures:
    steps = _delta(before.steps, after.steps)
    stalls = _delta_map(before.stalls, after.stalls)
    seconds = _delta_map(before.stall_seconds, after.stall_seconds)
    busy = _delta(before.busy_seconds, after.busy_seconds)
    idle = _delta(before.idle_seconds, after.idle_seconds)
    per_step = None
    if stalls is not None and steps:
        per_step = {site: n / steps for site, n in sorted(stalls.items())}
    return StallFigures(
        steps=steps,
        overlap_steps=_delta(before.overlap_steps, after.overlap_steps),
        stalls_total=None if stalls is None else sum(stalls.values()),
        stalls_per_step=per_step,
        stall_seconds=None if seconds is None else sum(seconds.values()),
        stall_seconds_by_site=seconds,
        device_busy_seconds=busy,
        device_idle_seconds=idle,
        device_idle_fraction=_ratio(idle, None if busy is None or idle is None else busy + idle),
        mean_schedule_seconds=_ratio(
            _delta(before.schedule_sum, after.schedule_sum),
            _delta(before.schedule_count, after.schedule_count),
        ),
        prefix_cache_hit_rate=_ratio(
            _delta(before.prefix_hits, after.prefix_hits),
            _delta(before.prefix_queries, after.prefix_queries),
        ),
        sites=sorted(stalls or {}),
        workers=rank_figures(before.workers, after.workers),
        spec=spec_figures(before.spec, after.spec),
    )
