"""The host side of speculation: draft counts, adaptive turn-off and probes, measured step
costs."""

from __future__ import annotations

from stallfree.config import SpeculativeConfig
from stallfree.runtime.request.req import Req
from stallfree.runtime.request.sampling_params import SamplingParams
from stallfree.runtime.scheduling import spec_policy
from stallfree.runtime.scheduling.spec_policy import SpecPolicy, StepCosts
from stallfree.runtime.telemetry.stats import EngineCounters


def req(rid: str = "r", max_new_tokens: int = 64, **params) -> Req:
    sp = SamplingParams(max_new_tokens=max_new_tokens, **params)
    return Req(rid, [1, 2, 3], sp, max_context_len=1000)


def policy(k: int = 4, costs: StepCosts | None = None, **cfg) -> SpecPolicy:
    return SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=k, **cfg), costs)


def test_k_is_capped_by_what_the_request_may_still_produce():
    p = policy(k=4)
    r = req(max_new_tokens=3)
    assert p.plan([r]) == [2]  # 3 outputs left: 2 drafts and the step's own token
    r.num_scheduled_outputs = 2
    assert p.plan([r]) == [0]


def test_requests_whose_processing_needs_exact_indices_carry_no_drafts():
    p = policy()
    rows = [
        req("pen", frequency_penalty=0.5),
        req("min", min_tokens=3),
        req("lp", logprobs=1),
        req("bias", logit_bias={5: 1.0}),
    ]
    assert p.plan(rows) == [0, 0, 0, 4]


def test_a_request_whose_drafts_fail_turns_off_probes_and_backs_off():
    p, stats, r = policy(), EngineCounters(), req(max_new_tokens=10_000)
    for _ in range(spec_policy.MIN_STEPS):
        assert p.plan([r]) == [4]
        p.observe(r, 4, 0, stats)
    assert r.spec_off and stats.spec_requests_disabled == 1
    waits = []
    for _ in range(3):  # three failed probes: the wait doubles each time
        steps = 0
        while p.plan([r]) == [0]:
            p.launched([r], [0])
            steps += 1
        waits.append(steps)
        p.observe(r, 4, 0, stats)
    assert waits == [16, 32, 64]
    while p.plan([r]) == [0]:
        p.launched([r], [0])
    p.observe(r, 4, 3, stats)  # a probe that clears the bar: on again
    assert not r.spec_off and p.plan([r]) == [4]
    assert stats.spec_requests_disabled == 1  # requests, not times


def test_measured_costs_decide_how_many_drafts_a_batch_carries():
    costs = StepCosts()
    rows = [req(str(i)) for i in range(16)]
    for r in rows:
        r.spec_rate, r.spec_steps = 0.9, 4
    p = policy(k=4, costs=costs)
    assert p.plan(rows) == [0] * 16  # no step of 16 tokens measured yet: measure one
    costs.observe(16, 0.08)
    assert p.plan(rows) == [1] * 16  # the smallest plan that could pay is tried first
    # on a CPU past its matrix-bound point a step costs in proportion to its tokens
    for tokens, seconds in ((32, 0.16), (48, 0.24), (80, 0.40)):
        costs.observe(tokens, seconds)
    assert p.plan(rows) == [0] * 16  # 16 tokens / 0.08 s beats every plan with drafts
    for r in rows:
        r.spec_rate = 0.2  # too few accepted to try what was never measured
    fresh = StepCosts()
    fresh.observe(16, 0.08)
    assert policy(k=4, costs=fresh).plan(rows) == [0] * 16
    one = [req("alone")]
    one[0].spec_rate, one[0].spec_steps = 0.5, 4
    for tokens, seconds in ((1, 0.030), (2, 0.031), (3, 0.032), (5, 0.034)):
        costs.observe(tokens, seconds)  # a small batch: k + 1 positions cost about one
    assert p.plan(one) == [4]


def test_a_stale_cost_is_measured_again():
    costs = StepCosts()
    costs.observe(8, 0.05)
    assert costs.estimate(7) == 0.05  # same power-of-two bucket
    for _ in range(spec_policy.STALE_STEPS + 1):
        costs.observe(1, 0.01)
    assert costs.estimate(8) is None
