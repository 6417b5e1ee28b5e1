"""Speculative decoding's n-gram proposals on the device stream.

`ngram_propose` is prompt lookup (vLLM's `ngram` proposer) for a whole batch: each row's
longest suffix of `min_n..max_n` tokens that also occurs earlier in its history, and the
tokens that followed that earlier occurrence. `speculative.NgramProposer` runs it on the stream.

Nothing here may synchronise with the device: no `.item()`, no branch or loop on a device
value, no op whose output shape depends on one. Every shape comes from the inputs' shapes and
the Python int arguments, so it runs on any device without a host round trip.
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
