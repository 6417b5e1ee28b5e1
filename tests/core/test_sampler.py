from __future__ import annotations

import pytest
import torch

from stallfree.runtime.execution import sampler as sampler_mod
from stallfree.runtime.execution.sampler import Sampler, SamplingBatch, noise_seed
from stallfree.runtime.request.sampling_params import SamplingParams

V = 64


def _batch(params: list[SamplingParams], steps: list[int] | None = None) -> SamplingBatch:
    return SamplingBatch.build(params, steps or [0] * len(params), lambda t: t.clone())


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * 3


def test_build_fields() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=3)]
    sb = _batch(params, [0, 4])
    assert sb.temperatures.tolist() == [0.0, 0.699999988079071]
    assert sb.top_ks.dtype == torch.int64 and sb.top_ks.tolist() == [-1, 5]
    assert sb.top_ps.dtype == torch.float32
    assert not sb.all_greedy and sb.needs_filter
    assert sb.greedy_mask_cpu == [True, False]
    assert (sb.seeds_cpu, sb.steps_cpu) == ([None, 3], [0, 4])
    assert _batch([SamplingParams(temperature=1.0, top_k=1)]).all_greedy


def test_greedy_is_argmax() -> None:
    logits = _logits(8)
    sampler = Sampler(0, "cpu")
    out = sampler.sample(logits, _batch([SamplingParams()] * 8))
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_rows_in_mixed_batch() -> None:
    logits = _logits(4)
    params = [SamplingParams(), SamplingParams(temperature=5.0)] * 2
    out = Sampler(0, "cpu").sample(logits, _batch(params))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_one_and_tiny_top_p_are_argmax() -> None:
    logits = _logits(6)
    sampler = Sampler(0, "cpu")
    # top_k=1 via params is greedy; force the filter path with a top_k=1 row that is not greedy
    sb = _batch([SamplingParams(temperature=2.0, top_k=2)] * 6)
    sb.top_ks = torch.ones(6, dtype=torch.int64)
    for _ in range(5):
        assert torch.equal(sampler.sample(logits, sb), logits.argmax(-1))
    sb = _batch([SamplingParams(temperature=2.0, top_p=1e-6)] * 6)
    for _ in range(5):
        assert torch.equal(sampler.sample(logits, sb), logits.argmax(-1))


def test_top_k_restricts_support() -> None:
    logits = _logits(1)
    allowed = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(1, "cpu")
    sb = _batch([SamplingParams(temperature=10.0, top_k=3)])
    seen = {int(sampler.sample(logits, sb)) for _ in range(200)}
    assert seen == allowed


def test_seeded_row_independent_of_batch_composition() -> None:
    target = _logits(1, seed=7)[0]
    seeded = SamplingParams(temperature=1.5, top_p=0.9, seed=1234)
    other = SamplingParams(temperature=1.0)
    results = []
    for batch_size, pos, sampler_seed in [(1, 0, 0), (4, 2, 1), (7, 6, 2), (3, 0, 3)]:
        logits = _logits(batch_size, seed=batch_size)
        logits[pos] = target
        params = [other] * batch_size
        params[pos] = seeded
        steps = list(range(batch_size))
        steps[pos] = 11
        out = Sampler(sampler_seed, "cpu").sample(logits, _batch(params, steps))
        results.append(int(out[pos]))
    assert len(set(results)) == 1


def test_seeded_row_varies_with_step() -> None:
    logits = torch.zeros(1, V)
    params = [SamplingParams(temperature=1.0, seed=5)]
    sampler = Sampler(0, "cpu")
    tokens = {int(sampler.sample(logits, _batch(params, [step]))) for step in range(50)}
    assert len(tokens) > 10
    assert noise_seed(5, 1) != noise_seed(5, 2) != noise_seed(6, 1)


def test_flat_distribution_covers_all_tokens() -> None:
    logits = torch.full((2000, 4), 0.0)
    sampler = Sampler(0, "cpu")
    out = sampler.sample(logits, _batch([SamplingParams(temperature=1.0)] * 2000))
    counts = torch.bincount(out, minlength=4)
    # expected 500 each; sd ~19, so these bounds are far out in the tails
    assert counts.min() > 400 and counts.max() < 600


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    sampler = Sampler(0, "cpu")

    def top_share(temp: float) -> float:
        out = sampler.sample(logits, _batch([SamplingParams(temperature=temp)] * 4000))
        return float((out == 0).float().mean())

    cold, warm, hot = top_share(0.25), top_share(1.0), top_share(4.0)
    assert cold > 0.95
    assert 0.55 < warm < 0.75  # softmax([2,1,0,-1])[0] ~= 0.644
    assert hot < 0.45


def test_output_dtype_and_shape_on_cpu() -> None:
    logits = _logits(5)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=4, seed=9),
        SamplingParams(temperature=1.2, top_p=0.5),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.8),
    ]
    out = Sampler(0, "cpu").sample(logits, _batch(params, [0, 1, 2, 3, 4]))
    assert out.dtype == torch.int64 and out.shape == (5,) and out.device.type == "cpu"
    assert bool(((out >= 0) & (out < V)).all())


def test_min_p_equals_transformers_min_p_warper() -> None:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    cases = [(0.1, 1.0, -1), (0.3, 0.7, -1), (0.05, 1.3, 10), (0.0, 1.0, -1)]
    params = [
        SamplingParams(min_p=m, temperature=t, top_k=k, max_new_tokens=1) for m, t, k in cases
    ]
    sb = SamplingBatch.build(params, [0] * 4, lambda t: t)
    assert sb.min_ps is not None
    got = Sampler(0, "cpu").probs(logits, sb)
    for row, (min_p, temperature, top_k) in enumerate(cases):
        scores = logits[row : row + 1]
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k > 0:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if min_p > 0:
            scores = MinPLogitsWarper(min_p)(None, scores)
        want = torch.softmax(scores, dim=-1)[0]
        assert torch.equal(got[row] > 0, want > 0), row  # the same tokens kept
        torch.testing.assert_close(got[row], want, atol=1e-6, rtol=1e-5)
    # min_p cut something in each row that set it
    assert all((got[r] == 0).sum() > 0 for r in range(3))


def test_min_p_off_uploads_nothing_and_one_keeps_only_the_top() -> None:
    assert SamplingBatch.build([SamplingParams(temperature=1.0)], [0], lambda t: t).min_ps is None
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    sb = SamplingBatch.build([SamplingParams(temperature=2.0, min_p=1.0)], [0], lambda t: t)
    sampler = Sampler(0, "cpu")
    assert sampler.probs(logits, sb).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert {int(sampler.sample(logits, sb)[0]) for _ in range(20)} == {1}


def _filters(
    rows: int, vocab: int, spread: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * spread
    ks = torch.tensor([[-1, 1, 5, 50, 700, vocab + 3][i % 6] for i in range(rows)])
    ps = torch.tensor([[1.0, 0.9, 0.5, 0.99, 1e-6, 0.3][(i * 5 + seed) % 6] for i in range(rows)])
    return logits, ks, ps


def test_a_cpu_batch_cuts_from_its_top_candidates_as_the_full_sort_does() -> None:
    """The CPU's filter from each row's top candidates (then more, then the full sort) keeps
    what the full sort keeps: the same tokens for every top-k, and for a top-p nucleus the
    same up to the float rounding of the mass at its edge (the probabilities are summed in
    another order): the smaller kept set inside the larger, a token or two apart."""
    vocab = 6000
    for seed in range(12):
        logits, ks, ps = _filters(12, vocab, spread=1.0 + seed, seed=seed)
        want = sampler_mod._filter_sorted(logits, ks, ps)
        got = sampler_mod._filter_top_k_top_p(logits, ks, ps)
        for row in range(12):
            kept_w, kept_g = ~torch.isinf(want[row]), ~torch.isinf(got[row])
            if ps[row] >= 1.0:
                assert torch.equal(got[row], want[row])
                continue
            small, large = sorted((kept_w, kept_g), key=lambda k: int(k.sum()))
            assert bool((small <= large).all())
            assert int(large.sum() - small.sum()) <= 3
            assert torch.equal(got[row][small & large], want[row][small & large])


def test_a_peaked_cpu_batch_filters_without_a_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    sorts: list[int] = []
    real = torch.sort

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        sorts.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "sort", counted)
    peaked, ks, ps = _filters(8, 49152, spread=12.0, seed=1)
    out = sampler_mod._filter_top_k_top_p(peaked, ks, ps)
    assert sorts == []
    assert torch.equal(out, sampler_mod._filter_sorted(peaked, ks, ps))
    # a flat row at top_p 0.99 keeps more than the candidates hold: the full sort decides it
    flat = torch.zeros(1, 49152)
    out = sampler_mod._filter_top_k_top_p(flat, torch.tensor([-1]), torch.tensor([0.99]))
    assert len(sorts) == 2  # the call above compared against, and this one
    assert int((~torch.isinf(out)).sum()) > sampler_mod.CANDIDATES[-1]


def test_sampling_noise_is_exponential() -> None:
    """-log(U) noise: positive, finite almost surely, mean and variance 1."""
    sampler = Sampler(3, "cpu")
    sb = _batch([SamplingParams(temperature=1.0)] * 4)
    noise = sampler.exponential(torch.zeros(4, 50000), sb)
    assert bool((noise > 0).all())
    assert abs(float(noise.mean()) - 1.0) < 0.01
    assert abs(float(noise.var()) - 1.0) < 0.03


def test_the_cpu_draw_follows_each_rows_distribution() -> None:
    """The inverse transform on the CPU: each token drawn about as often as its probability,
    a token of probability 0 never, and each row from its own distribution."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.1, 0.9]])
    sampler = Sampler(11, "cpu")
    sb = _batch([SamplingParams(temperature=1.0)] * 2)
    draws = torch.stack([sampler.inverse_cdf(probs, sb) for _ in range(20000)])
    first = torch.bincount(draws[:, 0], minlength=5).double() / 20000
    second = torch.bincount(draws[:, 1], minlength=5).double() / 20000
    # sd of a share near 0.3 over 20000 draws is about 0.0032
    assert torch.allclose(first, probs[0].double(), atol=0.015)
    assert torch.allclose(second, probs[1].double(), atol=0.015)
    assert int(first[3:].sum() * 20000) == 0 and int(second[:3].sum() * 20000) == 0


def test_a_seeded_cpu_draw_repeats() -> None:
    probs = torch.softmax(_logits(3, seed=4), dim=-1)
    params = [SamplingParams(temperature=1.0, seed=99)] * 3
    one = Sampler(0, "cpu").inverse_cdf(probs, _batch(params, [5, 6, 7]))
    two = Sampler(1, "cpu").inverse_cdf(probs, _batch(params, [5, 6, 7]))
    assert torch.equal(one, two)
