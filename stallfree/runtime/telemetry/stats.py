"""The engine's one set of counters, and the snapshot every reader takes of them.

The scheduler and the loop add to `EngineCounters` on the event loop; nothing on the hot path
reads them back. Metrics, the bench and the tests all read `Engine.snapshot()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stallfree.runtime.telemetry.observer import EngineObserver

if TYPE_CHECKING:
    from stallfree.runtime.request.req import Req


@dataclass(frozen=True, slots=True)
class SparseStats:
    """Cumulative transfer counters and current occupancy of a sparse-attention plug-in."""

    hits: int = 0  # top-k selections found in the device buffer
    misses: int = 0  # top-k selections copied in from the host
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    host_pool_used: int = 0
    host_pool_total: int = 0
    buffer_slots_used: int = 0
    buffer_slots_total: int = 0
    rows_tracked: int = 0

    @property
    def all_free(self) -> bool:
        return self.host_pool_used == 0 and self.buffer_slots_used == 0 and not self.rows_tracked


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0  # prompt tokens of requests, counted once at first scheduling
    prefill_tokens: int = 0  # tokens computed by extend batches (re-prefills included)
    generation_tokens: int = 0  # output tokens accepted
    prefill_batches: int = 0
    decode_batches: int = 0
    mixed_batches: int = 0  # steps that carried decode rows and a prefill chunk together
    steps: int = 0  # batches launched
    overlap_steps: int = 0  # launches made while an earlier batch was still unprocessed
    retractions: int = 0
    step_failures: int = 0  # launched steps that failed on the device
    launch_failures: int = 0  # batches whose building or launch raised (their requests failed)
    backpressure_pauses: int = 0  # streaming requests paused because their readers fell behind
    # prefix cache, in tokens: what admissions looked up, what they found cached, what eviction
    # gave back to the pool
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evicted_tokens: int = 0
    schedule_seconds: float = 0.0  # host time to build and launch batches
    # structured output: stream time spent on grammars (masks and advances) and the
    # constrained tokens it covered (execution/grammar_masks.py)
    grammar_seconds: float = 0.0
    grammar_tokens: int = 0
    max_iteration_gap: float = 0.0  # longest loop iteration while work was pending
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    # speculative decoding, counted on the host from each step's one device-to-host copy:
    # verify rows that carried at least one draft, the drafts they carried, the drafts
    # accepted, accepted drafts by position (index 0 is the first draft), and requests that
    # stopped proposing because their drafts were mostly rejected (adaptive)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_requests_disabled: int = 0

    def copy(self) -> EngineCounters:
        skip = ("finished", "spec_accepted_per_pos")
        return EngineCounters(
            **{name: getattr(self, name) for name in self.__slots__ if name not in skip},
            finished=dict(self.finished),
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
        )


@dataclass(frozen=True, slots=True)
class SpecStats:
    """Speculative decoding's figures, as vLLM defines them: acceptance rate is accepted over
    proposed draft tokens; mean acceptance length counts the token every verify step makes."""

    method: str
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    requests_disabled: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @classmethod
    def from_counters(cls, method: str, k: int, counters: EngineCounters) -> SpecStats:
        per_pos = list(counters.spec_accepted_per_pos) + [0] * k
        return cls(
            method=method,
            num_speculative_tokens=k,
            num_drafts=counters.spec_num_drafts,
            num_draft_tokens=counters.spec_num_draft_tokens,
            num_accepted_tokens=counters.spec_num_accepted_tokens,
            accepted_per_pos=tuple(per_pos[:k]),
            requests_disabled=counters.spec_requests_disabled,
        )


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """Request slots and KV tokens. KV tokens are free, held by the prefix cache, or in use.

    `kv_tokens_cached` are the tokens the prefix cache holds; `kv_tokens_evictable` are those of
    them no request uses, which an allocation takes back on demand. So "nothing in use" is
    `kv_tokens_free + kv_tokens_evictable == kv_tokens_total`, cache flushed or not.
    """

    req_slots_free: int
    req_slots_total: int
    kv_tokens_free: int  # in the allocator's free list
    kv_tokens_total: int
    kv_tokens_cached: int = 0
    kv_tokens_evictable: int = 0

    @property
    def all_free(self) -> bool:
        """No request holds a slot or a KV token (cached tokens nobody uses count as free)."""
        return (
            self.req_slots_free == self.req_slots_total
            and self.kv_tokens_free + self.kv_tokens_evictable == self.kv_tokens_total
        )

    @property
    def kv_usage(self) -> float:
        """Share of KV tokens requests use (not free, not evictable cache), 0 to 1."""
        if not self.kv_tokens_total:
            return 0.0
        return 1.0 - (self.kv_tokens_free + self.kv_tokens_evictable) / self.kv_tokens_total

    @property
    def cache_usage(self) -> float:
        """Share of KV tokens the prefix cache holds, locked or not, 0 to 1."""
        return self.kv_tokens_cached / self.kv_tokens_total if self.kv_tokens_total else 0.0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Everything a scrape needs, read at one moment without waiting for the device."""

    running: int
    waiting: int
    pools: PoolUsage
    counters: EngineCounters
    stalls: dict[str, int]  # host_read calls by site
    stall_seconds: dict[str, float]
    mirror_reads: dict[str, int]  # reads served by a CPU mirror, by field
    device_busy_seconds: float
    device_idle_seconds: float  # while requests were in the engine
    sparse: SparseStats | None = None
    max_context_len: int = 0  # the engine's longest sequence (0: unknown), for bucket bounds
    # worker processes: one entry per rank on this node; empty in process (in-process model)
    workers: tuple[WorkerRankStats, ...] = ()
    # speculative decoding's figures; None when it is off
    spec: SpecStats | None = None
    dtype: str = ""  # the weights' dtype as loaded ("bfloat16"); "" when unknown


@dataclass(frozen=True, slots=True)
class WorkerRankStats:
    """A worker rank's cumulative figures (read from shared host memory, never the device)."""

    rank: int
    steps: int
    step_seconds: float
    comm_seconds: float  # in tensor-parallel collectives (all-reduce, all-gather)
    comm_bytes: int
    message_bytes: int = 0  # step messages the scheduler sent (rank 0 only)


class ActivityClock(EngineObserver):
    """Wall time during which at least one request was in the engine."""

    def __init__(self) -> None:
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def on_request_added(self, req: Req) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def on_request_finished(self, req: Req, now: float) -> None:
        self._active -= 1
        if self._active <= 0:
            self._active = 0
            self._total += now - self._since

    def seconds(self, now: float) -> float:
        return self._total + (now - self._since if self._active else 0.0)
