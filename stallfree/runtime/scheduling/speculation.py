"""Speculative decoding on the host: how many drafts each request carries, and what a processed
verify step tells the host.

`SpecPolicy.plan` decides each row's `k` from host facts only. It is capped so that no request
ever schedules past `max_new_tokens` or its context (`remaining_outputs` counts every draft in
flight as if accepted), and is 0 for requests whose logits processing depends on the exact
output index (penalties, `min_tokens`, logprobs): they decode one token per step inside the
verify batch, exactly as without speculation.

Adaptive speculation (`speculative.adaptive`): each request keeps a running acceptance rate
(accepted drafts over the drafts it was planned to carry, so a step whose proposer found
nothing counts as a miss: it paid for `k + 1` positions and gained one token). Below
`min_acceptance_rate` the request stops proposing and decodes normally; every
`PROBE_INTERVAL` steps it carries drafts once more, and a probe whose rate clears the bar
turns speculation back on (its text turned repetitive again).
"""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.config import SpeculativeConfig
from stallfree.runtime.request.req import Req
from stallfree.runtime.telemetry.stats import EngineCounters

# steps a request that stopped proposing decodes normally between two probes
PROBE_INTERVAL = 16
# weight of the newest step in the running acceptance rate
RATE_WEIGHT = 0.3
# drafted steps before a request may be turned off (its first steps are not a judgement)
MIN_STEPS = 3


def speculates(req: Req) -> bool:
    """Whether a request's logits processing allows drafts: penalties count outputs, and
    `min_tokens` and logprobs read each output's exact index, which a draft window blurs."""
    params = req.sampling_params
    return not (params.has_penalties or params.min_tokens > 0 or params.logprobs is not None)


@dataclass(slots=True)
class SpecPolicy:
    config: SpeculativeConfig

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def plan(self, reqs: list[Req]) -> list[int]:
        """Each row's draft count for the next verify step (no state changes)."""
        return [self._k(r) for r in reqs]

    def _k(self, req: Req) -> int:
        if not speculates(req):
            return 0
        if req.spec_off and req.spec_idle % PROBE_INTERVAL != PROBE_INTERVAL - 1:
            return 0
        return max(0, min(self.k, req.remaining_outputs() - 1))

    def launched(self, reqs: list[Req], ks: list[int]) -> None:
        for req, k in zip(reqs, ks, strict=True):
            if req.spec_off and k == 0:
                req.spec_idle += 1

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
            return
        req.spec_steps += 1
        req.spec_rate += RATE_WEIGHT * (rate - req.spec_rate)
        if req.spec_steps >= MIN_STEPS and req.spec_rate < self.config.min_acceptance_rate:
            req.spec_off = True
            req.spec_idle = 0
            stats.spec_requests_disabled += 1


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
