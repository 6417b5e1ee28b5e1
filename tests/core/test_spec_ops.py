"""The n-gram proposer against a plain-Python reference, and the rejection sampler's
hand-worked cases plus chi-square checks that its output is distributed as the target's."""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch

from stallfree.runtime.execution.ngram_proposer import ngram_propose
from stallfree.runtime.execution.rejection_sampler import rejection_sample

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------------------------------------
# ngram_propose


def ngram_propose_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix m in [min_n, max_n] that occurs earlier followed by a token; the
    earliest such occurrence; the (up to) k tokens after it."""
    n = len(tokens)
    for m in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = tokens[n - m :]
        for j in range(n - m):  # j + m <= n - 1
            if tokens[j : j + m] == suffix:
                return tokens[j + m : j + m + k]
    return []


def _propose_rows(
    rows: list[list[int]], k: int, min_n: int, max_n: int, width: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Pads `rows` with garbage from the same vocabulary (so a bug reading it would match)."""
    rng = random.Random(seed)
    flat = [t for r in rows for t in r] or [0]
    lo, hi = min(flat), max(flat)
    padded = [r + [rng.randint(lo, hi) for _ in range(width - len(r))] for r in rows]
    hist = torch.tensor(padded, dtype=torch.int64).view(len(rows), width)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    drafts, counts = ngram_propose(hist, lens, k, min_n, max_n)
    assert drafts.shape == (len(rows), k) and drafts.dtype == torch.int64
    assert counts.shape == (len(rows),) and counts.dtype == torch.int64
    return drafts.tolist(), counts.tolist()


def _check_against_reference(
    rows: list[list[int]], k: int, min_n: int, max_n: int, width: int, seed: int = 0
) -> None:
    drafts, counts = _propose_rows(rows, k, min_n, max_n, width, seed)
    for row, got, count in zip(rows, drafts, counts, strict=True):
        want = ngram_propose_reference(row, k, min_n, max_n)
        assert got == want + [-1] * (k - len(want)), (row, k, min_n, max_n)
        assert count == len(want)


@pytest.mark.parametrize(
    ("k", "min_n", "max_n"), [(1, 1, 1), (3, 1, 3), (4, 2, 4), (5, 3, 5), (8, 1, 8), (2, 4, 4)]
)
def test_ngram_random_histories_match_reference(k: int, min_n: int, max_n: int) -> None:
    rng = random.Random(k * 100 + min_n * 10 + max_n)
    width = 48
    for _ in range(12):
        vocab = rng.choice([2, 3, 4, 6])
        low = rng.choice([0, -1])  # placeholder ids below 0 are tokens like any other here
        rows = [
            [low + rng.randrange(vocab) for _ in range(rng.randint(0, width))] for _ in range(16)
        ]
        _check_against_reference(rows, k, min_n, max_n, width, seed=rng.randrange(1 << 30))


@pytest.mark.parametrize(("k", "min_n", "max_n"), [(3, 1, 3), (5, 2, 6), (8, 3, 8)])
def test_ngram_repetitive_histories_match_reference(k: int, min_n: int, max_n: int) -> None:
    """Periodic text with a few edits: long matches, several candidate starts, near-misses."""
    rng = random.Random(7 + k)
    width = 96
    for _ in range(8):
        rows = []
        for _ in range(16):
            period = [rng.randrange(20) for _ in range(rng.randint(1, 7))]
            row = (period * width)[: rng.randint(0, width)]
            for _ in range(rng.randint(0, 3)):
                if row:
                    row[rng.randrange(len(row))] = rng.randrange(20)
            rows.append(row)
        _check_against_reference(rows, k, min_n, max_n, width, seed=rng.randrange(1 << 30))


def test_ngram_edge_cases() -> None:
    cases: list[tuple[list[int], int, int, int, list[int]]] = [
        ([], 3, 1, 3, []),  # L = 0
        ([5], 3, 1, 3, []),  # L = 1: no earlier token
        ([5, 5], 3, 2, 3, []),  # L <= min_n
        ([5, 5], 3, 1, 3, [5]),  # m = 1 at j = 0, clipped by L
        ([1, 2, 3, 1, 2], 4, 1, 3, [3, 1, 2]),  # match at the very start, proposal up to L
        ([7, 7, 7, 7], 5, 1, 3, [7]),  # overlapping: m = 3 at j = 0, only hist[3] follows
        ([7, 7, 7, 7, 7, 7], 2, 1, 2, [7, 7]),  # earliest start of the longest match
        ([1, 2, 9, 1, 2, 8, 2], 2, 1, 2, [9, 1]),  # only m = 1 matches: earliest "2"
        ([4, 1, 2, 3, 5, 2, 3, 6, 1, 2, 3], 3, 1, 3, [5, 2, 3]),  # longest (3) beats earlier 2
        ([1, 2, 3, 4, 9, 3, 4], 1, 3, 4, []),  # only shorter than min_n matches
        ([3, 1, 3], 8, 1, 3, [1, 3]),  # k larger than what follows
        ([1, 2, 1, 2], 0, 1, 2, []),  # k = 0
    ]
    for tokens, k, min_n, max_n, want in cases:
        assert ngram_propose_reference(tokens, k, min_n, max_n) == want, tokens
    width = 16
    for k in (0, 2, 5, 8):
        rows = [c[0] for c in cases]
        for min_n, max_n in [(1, 2), (1, 3), (2, 4), (3, 4)]:
            _check_against_reference(rows, k, min_n, max_n, width)
    for tokens, k, min_n, max_n, want in cases:
        drafts, counts = _propose_rows([tokens], k, min_n, max_n, width)
        assert drafts[0] == want + [-1] * (k - len(want)) and counts == [len(want)], tokens


def test_ngram_full_rows_and_garbage_never_read() -> None:
    rng = random.Random(3)
    rows = [[rng.randrange(3) for _ in range(24)] for _ in range(8)]
    _check_against_reference(rows, 4, 1, 4, 24)  # lens == W
    first = _propose_rows([r[:12] for r in rows], 4, 1, 4, 40, seed=1)
    assert first == _propose_rows([r[:12] for r in rows], 4, 1, 4, 40, seed=2)
    # garbage that would extend the suffix or the match if it were read
    hist = torch.tensor([[1, 2, 1, 2, 1, 2, 1, 2], [1, 2, 3, 1, 2, 3, 1, 2]])
    drafts, counts = ngram_propose(hist, torch.tensor([3, 4]), 4, 1, 3)
    assert drafts.tolist() == [[2, 1, -1, -1], [2, 3, 1, -1]] and counts.tolist() == [2, 3]


def test_ngram_empty_width_and_bad_arguments() -> None:
    drafts, counts = ngram_propose(
        torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 4, 1, 3
    )
    assert drafts.tolist() == [[-1] * 4] * 3 and counts.tolist() == [0, 0, 0]
    hist, lens = torch.zeros(1, 4, dtype=torch.int64), torch.tensor([4])
    for min_n, max_n in [(0, 3), (3, 2)]:
        with pytest.raises(ValueError, match="min_n"):
            ngram_propose(hist, lens, 2, min_n, max_n)


# ---------------------------------------------------------------------------------------------
# rejection_sample: worked cases


def _one_hot_probs(argmaxes: list[list[int]], vocab: int) -> torch.Tensor:
    """Target probabilities peaked (0.6) at each given token, the rest spread evenly."""
    probs = torch.full((len(argmaxes), len(argmaxes[0]), vocab), 0.4 / (vocab - 1))
    return probs.scatter(2, torch.tensor(argmaxes).unsqueeze(2), 0.6)


def _flat(batch: int, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms of 0.5 and noise of ones: the exponential race is then a plain argmax."""
    return torch.full((batch, k), 0.5), torch.ones(batch, k + 1, vocab)


def test_greedy_rows() -> None:
    vocab = 8
    target = _one_hot_probs([[3, 1, 4, 5], [3, 1, 4, 5], [3, 1, 4, 5], [3, 1, 4, 5]], vocab)
    drafts = torch.tensor([[3, 1, 4], [3, 2, 4], [6, 1, 4], [3, -1, -1]])
    greedy = torch.ones(4, dtype=torch.bool)
    uniforms, noise = _flat(4, 3, vocab)
    accepted, tokens = rejection_sample(target, greedy, drafts, None, uniforms, noise)
    assert accepted.tolist() == [3, 1, 0, 1]
    assert tokens.tolist() == [
        [3, 1, 4, 5],  # all accepted: the bonus is the last position's argmax
        [3, 1, -1, -1],  # mismatch in the middle: the target's token replaces it
        [3, -1, -1, -1],  # mismatch at once
        [3, 1, -1, -1],  # no draft after the first: the plain argmax at position 1
    ]
    # no drafts at all, and K = 0
    none = torch.full((1, 3), -1)
    accepted, tokens = rejection_sample(target[:1], greedy[:1], none, None, uniforms[:1], noise[:1])
    assert accepted.tolist() == [0] and tokens.tolist() == [[3, -1, -1, -1]]
    empty = torch.zeros(1, 0, dtype=torch.int64)
    accepted, tokens = rejection_sample(
        target[:1, :1], greedy[:1], empty, None, torch.zeros(1, 0), noise[:1, :1]
    )
    assert accepted.tolist() == [0] and tokens.tolist() == [[3]]


def test_mixed_greedy_and_sampled_rows() -> None:
    vocab = 5
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    target = p.expand(6, 3, vocab).clone()
    greedy = torch.tensor([True, True, False, False, False, False])
    drafts = torch.tensor([[3, 3], [2, 2], [2, 4], [1, 2], [3, 1], [2, -1]])
    uniforms = torch.tensor(
        [[0.9, 0.9], [0.0, 0.0], [0.25, 0.0], [0.15, 0.1], [0.5, 0.0], [0.29, 0.0]]
    )
    noise = torch.ones(6, 3, vocab)  # the race is a plain argmax of what it draws from
    accepted, tokens = rejection_sample(target, greedy, drafts, None, uniforms, noise)
    assert accepted.tolist() == [2, 0, 1, 2, 0, 1]
    assert tokens.tolist() == [
        [3, 3, 3],  # greedy: 3 is the argmax everywhere, whatever the uniforms
        [3, -1, -1],  # greedy: 2 is not the argmax, though a uniform of 0 would accept it
        [2, 3, -1],  # 0.25 <= p(2); p(4) = 0 is never accepted, not even on a uniform of 0
        [1, 2, 3],  # both accepted, then the bonus
        [2, -1, -1],  # 0.5 > p(3): the residual has no 3, its argmax is 2
        [2, 3, -1],  # accepted, no second draft: a plain draw from p
    ]


def test_sampled_rejection_draws_from_residual() -> None:
    vocab = 4
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    target = p.expand(3, 2, vocab).clone()
    greedy = torch.zeros(3, dtype=torch.bool)
    drafts = torch.tensor([[0], [0], [1]])
    uniforms = torch.tensor([[0.6], [0.5], [0.99]])  # reject, accept (0.5 <= 0.5), reject
    noise = torch.ones(3, 2, vocab)
    accepted, tokens = rejection_sample(target, greedy, drafts, None, uniforms, noise)
    assert accepted.tolist() == [0, 1, 0]
    # residual without token 0 is [0, .3, .2, 0] -> 1; without token 1: [.5, 0, .2, 0] -> 0
    assert tokens.tolist() == [[1, -1], [0, 0], [0, -1]]
    # with a draft distribution: accept iff u * q(d) <= p(d); residual max(p - q, 0)
    q = torch.tensor([0.8, 0.1, 0.1, 0.0]).expand(3, 1, vocab).clone()
    uniforms = torch.tensor([[0.7], [0.6], [0.1]])  # 0.56 > 0.5, 0.48 <= 0.5, q(1) < p(1)
    accepted, tokens = rejection_sample(target, greedy, drafts, q, uniforms, noise)
    assert accepted.tolist() == [0, 1, 1]
    assert tokens.tolist() == [[1, -1], [0, 0], [1, 0]]  # residual [0, .2, .1, 0] -> 1


def test_residual_all_zero_falls_back_to_target() -> None:
    # p == q leaves no residual; only a uniform outside [0, 1) can then reject, which makes
    # the fallback reachable here (in use it is rounding's doing)
    p = torch.tensor([[[0.0, 0.7, 0.3], [1.0, 0.0, 0.0]]])
    noise = torch.tensor([[[1.0, 1.0, 0.1], [1.0, 1.0, 1.0]]])  # the race favours token 2
    accepted, tokens = rejection_sample(
        p,
        torch.tensor([False]),
        torch.tensor([[1]]),
        p[:, :1].clone(),
        torch.tensor([[1.5]]),
        noise,
    )
    assert accepted.tolist() == [0] and tokens.tolist() == [[2, -1]]


# ---------------------------------------------------------------------------------------------
# rejection_sample: the output is distributed as the target (chi-square at p = 0.001)

Z_999 = 3.090232306167813  # the standard normal's 0.999 quantile
CHI2_999 = {4: 18.46682695, 5: 20.51500565, 29: 58.30117349}  # scipy.stats.chi2.ppf(0.999, d)
HAVE_SCIPY = importlib.util.find_spec("scipy") is not None


def _wilson_hilferty(dof: int) -> float:
    """The chi-square 0.999 quantile, within 1.5% above the exact one from 4 degrees of freedom."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + Z_999 * math.sqrt(c)) ** 3


def _critical(dof: int) -> float:
    if HAVE_SCIPY:
        from scipy.stats import chi2

        return float(chi2.ppf(0.999, dof))
    return _wilson_hilferty(dof)


def test_critical_values() -> None:
    for dof, exact in CHI2_999.items():
        assert exact <= _wilson_hilferty(dof) <= exact * 1.015
        assert _critical(dof) == pytest.approx(exact, rel=0.015)
    if HAVE_SCIPY:
        from scipy.stats import chi2

        for dof, exact in CHI2_999.items():
            assert chi2.ppf(0.999, dof) == pytest.approx(exact, rel=1e-8)


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of `samples` (cell ids) against `probs`; a cell of
    probability 0 must be empty (a statistic of inf otherwise)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double().flatten() * samples.numel()
    live = expected > 0
    if counts[~live].sum() > 0:
        return math.inf, int(live.sum()) - 1
    stat = ((counts[live] - expected[live]) ** 2 / expected[live]).sum().item()
    return stat, int(live.sum()) - 1


def _race(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Samples from `probs` [..., V] by the exponential race, as the sampler does."""
    return (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(dim=-1)


N = 40_000
VOCAB = 6
P = [
    torch.tensor([0.30, 0.05, 0.20, 0.00, 0.25, 0.20]),  # position 0 (one token impossible)
    torch.tensor([0.10, 0.20, 0.30, 0.15, 0.15, 0.10]),  # position 1, whatever came before
    torch.tensor([0.25, 0.05, 0.10, 0.30, 0.10, 0.20]),  # position 2
]
Q = [
    torch.tensor([0.10, 0.30, 0.10, 0.25, 0.05, 0.20]),  # mass where P[0] has none
    torch.tensor([0.30, 0.05, 0.05, 0.20, 0.20, 0.20]),
]


def _run(
    k: int, draft_tokens: list[int] | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """N sampled rows at K = k: drafts fixed to `draft_tokens` (deterministic proposal) or
    drawn from Q. Returns the full outputs with every -1 after the final token filled by a
    fresh draw from that position's target (what the next steps would sample, the target being
    context-free), and the drafts, uniforms, noise and accepted counts."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.stack(P[: k + 1]).expand(N, k + 1, VOCAB).contiguous()
    if draft_tokens is None:
        draft_probs = torch.stack(Q[:k]).expand(N, k, VOCAB).contiguous()
        drafts = _race(draft_probs, gen)
    else:
        draft_probs = None
        drafts = torch.tensor(draft_tokens).expand(N, k).contiguous()
    uniforms = torch.rand(N, k, generator=gen)
    noise = torch.empty(N, k + 1, VOCAB).exponential_(generator=gen)
    accepted, tokens = rejection_sample(
        target, torch.zeros(N, dtype=torch.bool), drafts, draft_probs, uniforms, noise
    )
    filled = torch.where(tokens >= 0, tokens, _race(target, gen))
    return filled, drafts, uniforms, noise, accepted


@pytest.mark.parametrize("draft_tokens", [[2], [3], None], ids=["fixed", "impossible", "q"])
def test_first_token_is_distributed_as_target_k1(draft_tokens: list[int] | None) -> None:
    filled, _, _, _, accepted = _run(1, draft_tokens, seed=11)
    stat, dof = _chi2(filled[:, 0], P[0])
    assert stat < _critical(dof), stat
    stat, dof = _chi2(filled[:, 1], P[1])
    assert stat < _critical(dof), stat
    # the acceptance rate is sum(min(p, q)) (p(d) for a fixed draft), within 4.5 sigma
    if draft_tokens is None:
        q = Q[0]
    else:
        q = torch.zeros(VOCAB)
        q[draft_tokens[0]] = 1.0
    rate = torch.minimum(P[0], q).sum().item()
    sigma = math.sqrt(max(rate * (1 - rate), 1e-12) / N)
    assert abs(accepted.double().mean().item() - rate) <= 4.5 * sigma + 1e-12


@pytest.mark.parametrize("draft_tokens", [[2, 1], [4, 3], None], ids=["fixed", "fixed2", "q"])
def test_first_two_tokens_are_distributed_as_target_k2(draft_tokens: list[int] | None) -> None:
    filled, _, _, _, accepted = _run(2, draft_tokens, seed=23)
    joint = torch.outer(P[0], P[1])
    stat, dof = _chi2(filled[:, 0] * VOCAB + filled[:, 1], joint)
    assert dof == 29 and stat < _critical(dof), stat
    stat, dof = _chi2(filled[:, 2], P[2])
    assert stat < _critical(dof), stat
    assert set(accepted.tolist()) == {0, 1, 2}


def test_chi_square_rejects_wrong_samplers() -> None:
    """The same checks fail on samplers that are not lossless: they have power at this N."""
    gen = torch.Generator().manual_seed(5)
    _, drafts, uniforms, _, accepted = _run(1, None, seed=11)
    first = drafts[:, 0]
    # always accepting: the first token is distributed as q (which puts mass where p has none)
    assert _chi2(first, P[0])[0] == math.inf
    # rejecting correctly but then drawing from p instead of the residual
    from_p = torch.where(accepted > 0, first, _race(P[0].expand(N, VOCAB), gen))
    stat, dof = _chi2(from_p, P[0])
    assert stat > 10 * _critical(dof)
    # the ratio test the wrong way round: accepting with probability min(1, q(d) / p(d))
    swapped_ok = (uniforms[:, 0] * P[0][first] <= Q[0][first]) & (P[0][first] > 0)
    residual = (P[0] - Q[0]).clamp_min(0).expand(N, VOCAB)
    stat, dof = _chi2(torch.where(swapped_ok, first, _race(residual, gen)), P[0])
    assert stat > 10 * _critical(dof)
    # K = 2, always accepting: the second token is distributed as q1
    filled, drafts, _, _, accepted = _run(2, None, seed=23)
    stat, dof = _chi2(drafts[:, 1], P[1])
    assert stat > 10 * _critical(dof)
    # K = 2, right at position 0 but drawing from p1 after a rejection at position 1
    second = torch.where(accepted == 1, _race(P[1].expand(N, VOCAB), gen), filled[:, 1])
    stat, dof = _chi2(filled[:, 0] * VOCAB + second, torch.outer(P[0], P[1]))
    assert stat > 10 * _critical(dof)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_syncing() -> None:
    rng = random.Random(9)
    rows = [[rng.randrange(3) for _ in range(rng.randint(0, 64))] for _ in range(16)]
    hist = torch.tensor([r + [0] * (64 - len(r)) for r in rows])
    lens = torch.tensor([len(r) for r in rows])
    want = ngram_propose(hist, lens, 5, 1, 4)
    filled, drafts, uniforms, noise, accepted = _run(2, None, seed=23)
    target = torch.stack(P).expand(N, 3, VOCAB).contiguous()
    draft_probs = torch.stack(Q).expand(N, 2, VOCAB).contiguous()
    greedy = torch.arange(N) % 3 == 0
    want_rs = rejection_sample(target, greedy, drafts, draft_probs, uniforms, noise)
    cuda = [t.cuda() for t in (hist, lens, target, greedy, drafts, draft_probs, uniforms, noise)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ngram_propose(cuda[0], cuda[1], 5, 1, 4)
        got_rs = rejection_sample(*cuda[2:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for w, g in zip((*want, *want_rs), (*got, *got_rs), strict=True):
        assert torch.equal(w, g.cpu())
    del filled, accepted
