"""Speculative decoding's lossless verification on the device stream.

`rejection_sample` verifies drafts against the target's probabilities (Leviathan et al. 2023,
Chen et al. 2023): accept draft `d` with probability `min(1, p(d) / q(d))`, on a rejection draw
from `max(p - q, 0)`, and after the last accepted draft draw one more token, so every row's
output is distributed as the target's. Greedy rows accept the drafts equal to the target's
argmax.

Nothing here may synchronise with the device: no `.item()`, no branch or loop on a device
value, no op whose output shape depends on one. Every shape comes from the inputs' shapes and
the Python int arguments, so it runs on any device without a host round trip.
"""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifies `drafts` [B, K] (-1 = none) against `target_probs` [B, K+1, V].

    `draft_probs` [B, K, V] is the distribution each draft was drawn from, or None for a
    deterministic proposal (one-hot at the draft). `uniforms` [B, K] in [0, 1) decide the
    acceptances; `noise` [B, K+1, V] Exponential(1) draws every token by `argmax(p / noise)`.
    Greedy rows accept a draft equal to the target's argmax and end on the argmax. Returns
    `accepted` [B] (a) and `tokens` [B, K+1]: the accepted drafts, the token at a, then -1.
    """
    batch, num_drafts = drafts.shape
    vocab = target_probs.shape[-1]
    device = drafts.device
    valid = drafts >= 0
    safe = drafts.clamp_min(0)
    p_draft = target_probs[:, :num_drafts].gather(2, safe.unsqueeze(2)).squeeze(2)
    target_argmax = target_probs.argmax(dim=2)
    greedy_ok = safe == target_argmax[:, :num_drafts]
    if draft_probs is None:
        sampled_ok = uniforms <= p_draft
    else:
        q_draft = draft_probs.gather(2, safe.unsqueeze(2)).squeeze(2)
        sampled_ok = uniforms * q_draft <= p_draft
    # a draft the target gives no mass is never accepted, not even on a uniform of exactly 0
    sampled_ok &= p_draft > 0
    ok = valid & torch.where(greedy.unsqueeze(1), greedy_ok, sampled_ok)
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)

    at = accepted.view(batch, 1)
    drafts_pad = torch.cat([drafts, drafts.new_full((batch, 1), -1)], dim=1)
    draft_at = drafts_pad.gather(1, at).squeeze(1)
    rejected = draft_at >= 0  # a valid draft at a: it was rejected (a == K has none)
    at_v = at.view(batch, 1, 1).expand(batch, 1, vocab)
    p_at = target_probs.gather(1, at_v).squeeze(1)
    if draft_probs is None:
        q_at = torch.zeros_like(p_at).scatter_(1, draft_at.clamp_min(0).view(batch, 1), 1.0)
    else:
        q_pad = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, vocab)], dim=1)
        q_at = q_pad.gather(1, at_v).squeeze(1).to(p_at.dtype)
    residual = (p_at - q_at).clamp_min(0.0)
    use_residual = rejected & (residual.sum(dim=1) > 0)  # all zero when p == q: draw from p
    dist = torch.where(use_residual.unsqueeze(1), residual, p_at)
    # exponential_ can return exactly 0 on some backends; 0/0 would win the argmax
    race = noise.gather(1, at_v).squeeze(1).clamp_min(torch.finfo(noise.dtype).tiny)
    sampled = (dist / race).argmax(dim=1)
    final = torch.where(greedy, target_argmax.gather(1, at).squeeze(1), sampled)

    cols = torch.arange(num_drafts + 1, device=device).unsqueeze(0)
    tokens = torch.where(cols < at, drafts_pad, torch.where(cols == at, final.unsqueeze(1), -1))
    return accepted, tokens
