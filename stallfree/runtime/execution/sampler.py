"""Token sampling on the device stream.

Nothing here may synchronise with the device: every branch is on host fields of
`SamplingBatch`, and device values only flow into further device ops.
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
        sampled = (probs / self.exponential(probs, sb)).argmax(dim=-1)
        return torch.where(greedy, greedy_ids, sampled)

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
        noise = torch.empty_like(probs).exponential_(generator=self._gen)
        for row, seed in enumerate(sb.seeds_cpu):
            if seed is None or sb.greedy_mask_cpu[row]:
                continue
            gen = torch.Generator(device=self.device)
            gen.manual_seed(noise_seed(seed, sb.steps_cpu[row]))
            noise[row].exponential_(generator=gen)
        # exponential_ can return exactly 0 on some backends; 0/0 would win the argmax
        return noise.clamp_min_(torch.finfo(probs.dtype).tiny)


def _filter_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Masks to -inf everything outside each row's top-k, then outside its top-p nucleus."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.where(top_ks > 0, top_ks, vocab).clamp_max(vocab).unsqueeze(1)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # mass strictly before each token; the first token (0) always stays since top_p > 0
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # rows at top_p == 1 skip the cut: rounding can push `before` just past 1.0
    nucleus_cut = (before > top_ps.unsqueeze(1)) & (top_ps < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(nucleus_cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
