"""Speculative decoding on the host: how many drafts each request carries, and what a processed
verify step tells the host.

`SpecPolicy.plan` decides each row's `k` from host facts only. It is capped so that no request
ever schedules past `max_new_tokens` or its context (`remaining_outputs` counts every draft in
flight as if accepted), and is 0 for requests whose logits processing depends on the exact
output index (penalties, `min_tokens`, logprobs): they decode one token per step inside the
verify batch, exactly as without speculation.

Cost-aware drafting: the same host measures what steps cost (`StepCosts`, the stream's time per
step by token count) and carries fewer drafts, or none, where the expected tokens per second
(each row's `1 + rate * k` over the step's measured time) is higher that way: on a CPU a
verify step costs about what a decode step does while the batch is small, and in proportion
to its tokens once matrix work dominates, so at high concurrency speculation turns itself off.

Adaptive speculation (`speculative.adaptive`): each request keeps a running acceptance rate
(accepted drafts over the drafts it was planned to carry, so a step whose proposer found
nothing counts as a miss: it paid for `k + 1` positions and gained one token). Below
`min_acceptance_rate` the request stops proposing and decodes normally (a batch where no row
carries drafts runs as a plain decode step). It probes again after `PROBE_INTERVAL` steps,
carrying drafts for one step; a probe whose rate clears the bar turns speculation back on (its
text turned repetitive again), and each failed probe doubles the wait, up to `MAX_PROBE_WAIT`.
"""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.config import SpeculativeConfig
from stallfree.runtime.execution.model_runner import StepOutput
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.request.req import Req
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.telemetry.stats import EngineCounters

# steps a request that stopped proposing decodes normally before its first probe, and the
# longest wait between probes (each failed probe doubles it)
PROBE_INTERVAL = 16
MAX_PROBE_WAIT = 256
# weight of the newest step in the running acceptance rate
RATE_WEIGHT = 0.3
# drafted steps before a request may be turned off (its first steps are not a judgement)
MIN_STEPS = 3
# weight of the newest step in the running step costs, and steps after which a token count's
# cost counts as unknown again (tried once more)
COST_WEIGHT = 0.2
STALE_STEPS = 500
# drafts must promise this much more throughput than no drafts: the estimates are noisy, and
# a marginal gain is not worth the risk of a loss
GAIN_MARGIN = 1.1
# weight of each drafted row in the engine-wide acceptance rate new requests start from
PRIOR_WEIGHT = 0.1


def speculates(req: Req) -> bool:
    """Whether a request's logits processing allows drafts: penalties count outputs, bad words
    compare the latest outputs, and `min_tokens` and logprobs read each output's exact index,
    which a draft window blurs."""
    params = req.sampling_params
    return not (
        params.has_penalties
        or params.min_tokens > 0
        or params.logprobs is not None
        or bool(params.bad_words)
    )


class StepCosts:
    """What a step of `T` tokens costs on this machine, measured: a running mean of the
    stream's time per step, by token count rounded up to a power of two. A count never seen
    (or not seen for `STALE_STEPS` steps) is unknown, and a plan that needs it is tried: that
    is how it gets measured."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._seen: dict[int, int] = {}
        self._steps = 0

    @staticmethod
    def _bucket(tokens: int) -> int:
        return max(tokens - 1, 0).bit_length()

    def observe(self, tokens: int, seconds: float) -> None:
        self._steps += 1
        b = self._bucket(tokens)
        old = self._seconds.get(b)
        self._seconds[b] = seconds if old is None else old + COST_WEIGHT * (seconds - old)
        self._seen[b] = self._steps

    def below(self, tokens: int) -> tuple[int, float]:
        """The largest measured token count (its bucket's top) under `tokens`, and its cost;
        (0, 0.0) when none is."""
        top = self._bucket(tokens)
        for b in range(top - 1, -1, -1):
            if b in self._seconds and self._steps - self._seen[b] <= STALE_STEPS:
                return 1 << b, self._seconds[b]
        return 0, 0.0

    def estimate(self, tokens: int) -> float | None:
        b = self._bucket(tokens)
        if b not in self._seconds or self._steps - self._seen[b] > STALE_STEPS:
            return None
        return self._seconds[b]


@dataclass(slots=True)
class SpecPolicy:
    config: SpeculativeConfig
    # measured step costs (None: not measured, e.g. on CUDA, where the stream's work is
    # asynchronous to the host that would time it); every plan then keeps its drafts
    costs: StepCosts | None = None
    # the acceptance rate of recent drafted rows, any request's: what a request that has not
    # drafted yet is expected to accept (so that a workload whose drafts fail does not try
    # again with each request it admits)
    prior: float = 1.0

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def plan(self, reqs: list[Req]) -> list[int]:
        """Each row's draft count for the next verify step (no state changes): each request's
        cap, then scaled down (halved, quartered, or none) where the measured step costs say
        the expected tokens per second is higher without them."""
        ks = [self._k(r) for r in reqs]
        if self.costs is None or not any(ks):
            return ks
        return self._cheapest(reqs, ks, self.costs)

    def _cheapest(self, reqs: list[Req], ks: list[int], costs: StepCosts) -> list[int]:
        """The plan with the most expected tokens per second: none, or every cap scaled by a
        quarter, a half or one. A plan whose cost is not measured yet is guessed from the
        largest measured count below it (time growing as the square root of the tokens: a
        guess between memory-bound, where it stays flat, and compute-bound, where it grows in
        proportion) and tried when the guess says it would win; plans are tried smallest
        first, so the costly ones are only tried once cheaper ones have been measured."""
        n = len(reqs)
        base = costs.estimate(n)
        if base is None:
            return [0] * n  # unmeasured: a step without drafts measures it
        best, best_rate = [0] * n, n / base
        for scale in (0.25, 0.5, 1.0):
            cand = [int(k * scale) for k in ks]
            tokens = n + sum(cand)
            if tokens == n:
                continue
            expected = sum(1 + self._rate(r) * k for r, k in zip(reqs, cand, strict=True))
            spent = costs.estimate(tokens)
            if spent is None:
                known, seconds = costs.below(tokens)
                guess = seconds * (tokens / max(known, n)) ** 0.5 if known else base
                if expected / guess > best_rate * GAIN_MARGIN:
                    return cand  # unmeasured, and it could pay: try it
                break  # a larger plan would only be guessed dearer
            if expected / spent > best_rate * GAIN_MARGIN:
                best, best_rate = cand, expected / spent
        return best

    def _rate(self, req: Req) -> float:
        """What a row is expected to accept per draft: a probe, just the bar it must clear."""
        if req.spec_off:
            return self.config.min_acceptance_rate
        return req.spec_rate if req.spec_steps else self.prior

    def observe_step(self, out: StepOutput, since_last: float | None) -> None:
        """A processed decode or verify step's cost, by its token count: the time since the
        last step was processed, which under overlap is the whole step as the engine runs it
        (host work on its tokens included), or the stream's own time where that interval
        cannot be one step's (the engine was idle, or waited for something else)."""
        if self.costs is None or out.seconds is None or not out.reqs:
            return
        seconds = out.seconds
        if since_last is not None and seconds <= since_last < 4 * seconds:
            seconds = since_last
        if out.verify is not None:
            self.costs.observe(sum(k + 1 for k in out.verify.ks), seconds)
        elif out.mode is ForwardMode.DECODE:
            self.costs.observe(len(out.reqs), seconds)

    def _k(self, req: Req) -> int:
        if not speculates(req):
            return 0
        if req.spec_off and req.spec_idle < req.spec_probe_wait:
            return 0
        return max(0, min(self.k, req.remaining_outputs() - 1))

    def launched(self, reqs: list[Req], ks: list[int]) -> None:
        for req, k in zip(reqs, ks, strict=True):
            if req.spec_off and k == 0:
                req.spec_idle += 1

    def settle(self, req: Req, k: int, accepted: int, stats: EngineCounters) -> None:
        """A processed verify row that carried `k` drafts and accepted `accepted`, its tokens
        applied: the drafts it rejected come off the request's upper bounds, and its
        acceptance rate learns from it."""
        rejected = k - accepted
        req.num_scheduled_outputs -= rejected
        if req.spec_window >= k + 1:  # not retracted since: its bounds are this life's
            req.spec_window -= k + 1
            req.spec_drafts -= k
            req.num_computed_tokens -= rejected
        self.observe(req, k, accepted, stats)

    def observe(self, req: Req, k: int, accepted: int, stats: EngineCounters) -> None:
        """A processed verify row that carried `k` drafts and accepted `accepted`."""
        if k == 0 or not self.config.adaptive:
            return
        rate = accepted / k
        if req.spec_off:  # a probe
            req.spec_idle = 0
            if rate >= self.config.min_acceptance_rate:
                req.spec_off = False
                req.spec_rate = rate
                req.spec_probe_wait = PROBE_INTERVAL
            else:
                req.spec_probe_wait = min(2 * req.spec_probe_wait, MAX_PROBE_WAIT)
            return
        self.prior += PRIOR_WEIGHT * (rate - self.prior)
        first = req.spec_steps == 0
        req.spec_steps += 1
        req.spec_rate = rate if first else req.spec_rate + RATE_WEIGHT * (rate - req.spec_rate)
        if req.spec_steps >= MIN_STEPS and req.spec_rate < self.config.min_acceptance_rate:
            req.spec_off = True
            req.spec_idle = 0
            req.spec_probe_wait = PROBE_INTERVAL
            if not req.spec_was_off:  # requests, not times: a probe may turn it on again
                req.spec_was_off = True
                stats.spec_requests_disabled += 1


@dataclass(slots=True)
class ParkedRequests:
    """Requests whose upper bound reached `max_new_tokens` or the context while a verify step
    of theirs is in flight: the next step cannot carry them (every draft might be accepted),
    yet the drafts it rejects may leave them short. They wait here, holding their slot and
    KV, until that step is processed, then rejoin the decode batch with exact lengths (or are
    done)."""

    reqs: list[Req]

    def park(self, req: Req) -> None:
        self.reqs.append(req)

    def rejoin(self, running: ScheduleBatch) -> None:
        """Requests ready again join `running`, their lengths and last tokens as they are."""
        if self.reqs and (back := self.take_ready()):
            batch = ScheduleBatch.init_new(back, running.ctx)
            batch.prepare_for_import(imported=False)
            running.merge_batch(batch)

    def take_ready(self) -> list[Req]:
        """Requests whose verify steps are all processed and that still decode."""
        ready = [r for r in self.reqs if r.spec_window == 0]
        self.reqs = [r for r in self.reqs if r.spec_window > 0 and not r.finished]
        return [r for r in ready if r.wants_more_decode() and r.req_pool_idx is not None]


def count_verify_row(stats: EngineCounters, offered: int, accepted: int) -> None:
    """vLLM's counters, from the host copy of one verify row."""
    if offered <= 0:
        return
    stats.spec_num_drafts += 1
    stats.spec_num_draft_tokens += offered
    stats.spec_num_accepted_tokens += accepted
    per_pos = stats.spec_accepted_per_pos
    if len(per_pos) < accepted:
        per_pos.extend([0] * (accepted - len(per_pos)))
    for j in range(accepted):
        per_pos[j] += 1
