"""Speculative decoding on the device stream: n-gram proposals and lossless verification.

`ngram_propose` is prompt lookup (vLLM's `ngram` proposer) for a whole batch: each row's
longest suffix of `min_n..max_n` tokens that also occurs earlier in its history, and the
tokens that followed that earlier occurrence. `rejection_sample` verifies drafts against the
target's probabilities (Leviathan et al. 2023, Chen et al. 2023): accept draft `d` with
probability `min(1, p(d) / q(d))`, on a rejection draw from `max(p - q, 0)`, and after the
last accepted draft draw one more token, so every row's output is distributed as the target's.

Nothing here may synchronise with the device: no `.item()`, no branch or loop on a device
value, no op whose output shape depends on one. Every shape comes from the inputs' shapes and
the Python int arguments, so both functions run on any device without a host round trip.
"""

from __future__ import annotations

import torch


def ngram_propose(
    hist: torch.Tensor, lens: torch.Tensor, k: int, min_n: int, max_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hist` [B, W] int64, valid in `[:lens[b]]`; `lens` [B] int64 -> `drafts` [B, k], `counts` [B].

    A match of length m ends at `e` (exclusive) when `hist[e-m:e] == hist[L-m:L]` and
    `m <= e <= L - 1`, so at least one token follows it. The longest m in `[min_n, max_n]`
    wins, then the earliest start; the proposal is `hist[e:e+k]` clipped at L. `drafts` holds
    -1 past each row's `counts` (0 where nothing matched).
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    batch, width = hist.shape
    device = hist.device
    if width == 0:
        drafts = torch.full((batch, k), -1, dtype=torch.int64, device=device)
        return drafts, torch.zeros(batch, dtype=torch.int64, device=device)
    lens = lens.to(torch.int64)
    ends = torch.arange(width, device=device)
    # the last max_n tokens of each row, newest first: tail[:, t] = hist[L-1-t]
    # (positions before 0 are clamped: a match is never longer than its end `e <= L - 1`)
    tail_pos = (lens.unsqueeze(1) - 1 - torch.arange(max_n, device=device)).clamp(0, width - 1)
    tail = hist.gather(1, tail_pos)
    # before[:, e + max_n - 1 - t] = hist[e - 1 - t]; the left padding never counts (capped below)
    padded = torch.cat([hist.new_full((batch, max_n), -1), hist], dim=1)
    # run[:, e]: how many tokens ending just before e equal the row's last tokens, up to max_n
    # (int32 and the bool chain keep the B*W*max_n compares cheap on the CPU)
    run = torch.zeros(batch, width, dtype=torch.int32, device=device)
    alive = torch.ones(batch, width, dtype=torch.bool, device=device)
    for t in range(max_n):
        before = padded[:, max_n - 1 - t : max_n - 1 - t + width]
        alive &= before == tail[:, t : t + 1]
        run += alive
    # a match cannot start before 0, nor end at L (that would be the suffix itself)
    head = min(max_n, width)
    run[:, :head] = torch.minimum(run[:, :head], ends[:head].to(torch.int32))
    run.masked_fill_(ends.unsqueeze(0) >= lens.unsqueeze(1), 0)
    best = run.amax(dim=1)
    found = best >= min_n
    # the earliest start j = e - best is the earliest end among the longest matches
    # (argmax returns the first maximal index)
    first_end = (run >= best.unsqueeze(1)).to(torch.uint8).argmax(dim=1)
    pos = first_end.unsqueeze(1) + torch.arange(k, device=device)
    valid = found.unsqueeze(1) & (pos < lens.unsqueeze(1))
    drafts = hist.gather(1, pos.clamp_max(width - 1)).masked_fill(~valid, -1)
    return drafts, valid.sum(dim=1)


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
