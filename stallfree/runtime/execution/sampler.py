"""Token sampling on the device stream.

Nothing here may synchronise with the device: every branch is on host fields of
`SamplingBatch`, and device values only flow into further device ops. The one branch on
values, how many top candidates a top-k/top-p cut needs, is taken only for a batch on the
CPU, where reading a value is no device sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stallfree.runtime.request.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingBatch:
    all_greedy: bool
    greedy_mask_cpu: list[bool]
    seeds_cpu: list[int | None]
    steps_cpu: list[int]
    needs_filter: bool = True  # some row has top_k or top_p set
    # device tensors, uploaded only when some row samples (None for an all-greedy batch)
    temperatures: torch.Tensor | None = None  # [B] float32; 0 marks a greedy row
    top_ps: torch.Tensor | None = None  # [B] float32
    top_ks: torch.Tensor | None = None  # [B] int64; -1 means the whole vocabulary
    min_ps: torch.Tensor | None = None  # [B] float32; None when no sampled row sets min_p

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        steps: list[int],
        upload: Callable[[torch.Tensor], torch.Tensor],
    ) -> SamplingBatch:
        greedy = [p.temperature == 0.0 or p.top_k == 1 for p in params]
        if all(greedy):
            # the common serving case: nothing to upload, nothing to seed
            return cls(all_greedy=True, greedy_mask_cpu=greedy, seeds_cpu=[], steps_cpu=[])
        temps = [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        min_ps = None
        if any(p.min_p > 0.0 for p in sampled):
            min_ps = upload(torch.tensor([p.min_p for p in params], dtype=torch.float32))
        return cls(
            all_greedy=False,
            greedy_mask_cpu=greedy,
            seeds_cpu=[p.seed for p in params],
            steps_cpu=list(steps),
            needs_filter=any(p.top_k != -1 or p.top_p < 1.0 for p in sampled),
            temperatures=upload(torch.tensor(temps, dtype=torch.float32)),
            top_ps=upload(torch.tensor([p.top_p for p in params], dtype=torch.float32)),
            top_ks=upload(torch.tensor([p.top_k for p in params], dtype=torch.int64)),
            min_ps=min_ps,
        )


# the seeded streams of `Sampler.inverse_cdf`'s draws, apart from the acceptance tests'
_DRAW_SALT = 0xD4A5


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, step: int) -> int:
    """Stable across processes and Python versions, unlike `hash()`."""
    return _splitmix64(_splitmix64(seed) ^ step) >> 1


class Sampler:
    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)

    def sample(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """`logits` [B, V] float32 -> next token ids [B] int64."""
        greedy_ids = logits.argmax(dim=-1)
        if sb.all_greedy:
            return greedy_ids
        assert sb.temperatures is not None
        greedy = sb.temperatures <= 0.0
        probs = self.probs(logits, sb)
        if probs.device.type == "cpu":
            sampled = self.inverse_cdf(probs, sb)
        else:
            sampled = (probs / self.exponential(probs, sb)).argmax(dim=-1)
        return torch.where(greedy, greedy_ids, sampled)

    def inverse_cdf(self, probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """One token per row of `probs` by the inverse transform: the first token whose
        cumulative probability passes a uniform draw times the row's total (seeded rows: the
        draw from their seed and output index). A token of probability 0 is never drawn. One
        draw a row instead of a noise value per token: on the CPU, where the noise of
        `exponential` cost 0.18-0.22 ms per 49152-token row, the cumulative sum (in float64)
        costs about 0.04 ms."""
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        draws = self.uniforms(sb, salt=_DRAW_SALT).to(torch.float64) * cdf[:, -1]
        ids = torch.searchsorted(cdf, draws.unsqueeze(1), right=True).squeeze(1)
        return ids.clamp_(max=probs.shape[-1] - 1)

    def probs(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Each row's distribution after temperature, top-k, top-p and min-p (greedy rows: at
        temperature 1; only their argmax is used). Not for an all-greedy batch."""
        assert sb.temperatures is not None and sb.top_ks is not None and sb.top_ps is not None
        greedy = sb.temperatures <= 0.0
        scaled = logits / torch.where(greedy, 1.0, sb.temperatures).unsqueeze(1)
        if sb.needs_filter:
            scaled = _filter_top_k_top_p(scaled, sb.top_ks, sb.top_ps)
        probs = torch.softmax(scaled, dim=-1)
        if sb.min_ps is not None:
            # transformers' MinPLogitsWarper: below min_p x the top probability is dropped
            # (the top token always stays); a row at 0 keeps everything
            floor = probs.amax(dim=-1, keepdim=True) * sb.min_ps.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def uniforms(self, sb: SamplingBatch, salt: int = 0x5EC) -> torch.Tensor:
        """One U[0, 1) draw per row (speculative acceptance tests), seeded rows from their own
        seed and output index, like the sampling noise but from a different stream."""
        n = len(sb.greedy_mask_cpu)
        out = torch.rand(n, generator=self._gen, device=self.device)
        for row, seed in enumerate(sb.seeds_cpu):
            if seed is None or sb.greedy_mask_cpu[row]:
                continue
            gen = torch.Generator(device=self.device)
            gen.manual_seed(noise_seed(seed ^ salt, sb.steps_cpu[row]))
            out[row] = torch.rand(1, generator=gen, device=self.device)[0]
        return out

    def exponential(self, probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Exp(1) noise for every row of `probs` (seeded rows from their seed and step):
        -log(U), U uniform on [0, 1), so never 0 (U = 0 gives inf: the token cannot win). The
        GPU's draw and speculative decoding's residual draws use it; torch's `exponential_`
        took 1.1 ms per 49152-token row on a CPU (2 threads), uniforms and their log 0.23 ms."""
        noise = _exp1(torch.rand(probs.shape, generator=self._gen, device=self.device))
        for row, seed in enumerate(sb.seeds_cpu):
            if seed is None or sb.greedy_mask_cpu[row]:
                continue
            gen = torch.Generator(device=self.device)
            gen.manual_seed(noise_seed(seed, sb.steps_cpu[row]))
            noise[row] = _exp1(torch.rand(probs.shape[-1], generator=gen, device=self.device))
        return noise


def _exp1(uniforms: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws from U[0, 1) draws, in place: -log(U)."""
    return uniforms.log_().neg_()


# Top candidates a CPU batch's filter tries first, then again (`_filter_candidates`), before a
# full sort: a CPU sorts a 49152-token row in about 3.5-4.5 ms (2 threads); its top 256 take
# about 0.2 ms, its top 4096 about 0.75 ms. A trained model's top-p nucleus is mostly far
# smaller; a flat distribution's (random weights, a high temperature) reaches past them.
CANDIDATES = (256, 4096)


def _filter_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Masks to -inf everything outside each row's top-k, then outside its top-p nucleus."""
    if logits.device.type == "cpu":
        for count in CANDIDATES:
            filtered = _filter_candidates(logits, top_ks, top_ps, count)
            if filtered is not None:
                return filtered
    return _filter_sorted(logits, top_ks, top_ps)


def _filter_candidates(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, count: int
) -> torch.Tensor | None:
    """`_filter_sorted`'s cut from each row's top candidates alone (`count`, or every row's
    top-k where more), for a batch on the CPU, where reading a value costs no device sync;
    None where a row's top-p nucleus may reach past them. A row without a top-k takes its
    probabilities over the whole vocabulary, as there."""
    vocab = logits.shape[-1]
    ks = _row_ks(top_ks, vocab)
    whole = ks >= vocab  # rows without a top-k
    count = min(vocab, max(count, int(torch.where(whole, 0, ks).max())))
    top, order = torch.topk(logits, count, dim=-1, sorted=True)
    ranks = torch.arange(count, device=logits.device).unsqueeze(0)
    top = top.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    # the softmax's denominator: over the top-k, or over the whole row without one
    norm = torch.where(whole, logits.logsumexp(dim=-1), top.logsumexp(dim=-1))
    probs = (top - norm.unsqueeze(1)).exp()
    mass = probs.cumsum(dim=-1)
    cuts = top_ps < 1.0
    if bool((whole & cuts & (mass[:, -1] <= top_ps)).any()):
        return None  # a nucleus past the candidates
    before = mass - probs
    top = top.masked_fill((before > top_ps.unsqueeze(1)) & cuts.unsqueeze(1), float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter(1, order, top)
    # a row that cuts nothing keeps its whole row
    return torch.where((whole & ~cuts).unsqueeze(1), logits, out)


def _row_ks(top_ks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each row's top-k as a count of tokens kept (the whole vocabulary where unset)."""
    return torch.where(top_ks > 0, top_ks, vocab).clamp_max(vocab)


def _filter_sorted(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """`_filter_top_k_top_p` from each row's full sort."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ks = _row_ks(top_ks, vocab).unsqueeze(1)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # mass strictly before each token; the first token (0) always stays since top_p > 0
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # rows at top_p == 1 skip the cut: rounding can push `before` just past 1.0
    nucleus_cut = (before > top_ps.unsqueeze(1)) & (top_ps < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(nucleus_cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
