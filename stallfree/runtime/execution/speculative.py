"""Speculative decoding on the stream: the proposers, and the verify step that accepts drafts.

Everything here runs on the device stream, in FIFO order with the steps around it, and reads
only device state and the host facts planned at launch (`SpecArgs`). The host never reads a
draft: a proposer writes each slot's drafts into the future map right after the step that
produced the slot's last token, and the next verify step resolves them there.

A verify step scores `k + 1` positions per request (its last token and `k` drafts). Greedy
rows accept the longest prefix of drafts that equal the target's argmax, then take the
target's token at the first mismatch (or the bonus token after the last draft). Sampled rows
use rejection sampling (`rejection_sampler.rejection_sample`), which keeps the target distribution
exactly. The step then lowers each row's device length by the drafts it rejected, appends
the accepted tokens to the slot's history; the next verify step proposes from there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from stallfree.overlap.future_map import FutureMap
from stallfree.runtime.execution.ngram_proposer import ngram_propose
from stallfree.runtime.execution.rejection_sampler import rejection_sample
from stallfree.runtime.execution.sampler import Sampler, SamplingBatch
from stallfree.runtime.memory.pool import KVCache
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode, VerifyLayout


class Proposer(Protocol):
    """Writes the drafts of a verify step into the future map (stream side), at the start of
    that step, before its target forward resolves them: after step N and its history writes,
    before step N + 1 reads anything, with nothing else between them on the stream."""

    def on_target_step(self, fmap: FutureMap, fb: ForwardBatch, spec: SpecArgs) -> None:
        """A prefill or plain decode step ran its target forward: a draft model writes its own
        KV for the same tokens."""

    def before_verify(self, fmap: FutureMap, fb: ForwardBatch, spec: SpecArgs) -> None:
        """The verify step `fb` is about to resolve its drafts."""


def last_positions(fb: ForwardBatch) -> torch.Tensor:
    """Stream side: each verify row's length on the device (its last token's position)."""
    assert fb.verify is not None
    return fb.positions[fb.verify.pad_index[:, 0]]


class NgramProposer:
    """Prompt lookup: the tokens that followed the longest earlier match of the history's
    suffix (`prompt_lookup_min` to `prompt_lookup_max` tokens long). No model."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def on_target_step(self, fmap: FutureMap, fb: ForwardBatch, spec: SpecArgs) -> None:
        return

    def before_verify(self, fmap: FutureMap, fb: ForwardBatch, spec: SpecArgs) -> None:
        assert fmap.history is not None and fmap.drafts is not None and fb.verify is not None
        slots = fb.req_pool_indices
        hist = fmap.history[:, : spec.width][slots]
        drafts, _ = ngram_propose(hist, last_positions(fb) + 1, self.k, self.min_n, self.max_n)
        fmap.drafts[slots, : drafts.shape[1]] = drafts


@dataclass(slots=True, eq=False)
class SpecArgs:
    """Host facts of one step for the speculative side, planned at launch."""

    width: int  # history columns the proposer reads (every row's valid length fits)
    # verify steps only:
    ks: torch.Tensor | None = None  # [B] drafts each row carries
    draft_mask: torch.Tensor | None = None  # [B, max_k] bool: position j < k of the row
    sb_pad: SamplingBatch | None = None  # sampling over the padded [B * (max_k + 1)] rows
    draft: DraftPlan | None = None  # a draft model's batches (None: no draft model)


@dataclass(slots=True, eq=False)
class DraftPlan:
    """The draft model's batches inside one verify step, decided on the host: a two-token
    step over every row (the token before its last, recomputed, and its last), then one
    single-token step per further draft over the rows that carry that many."""

    first: VerifyLayout  # every row, two tokens
    steps: list[tuple[torch.Tensor, list[int], VerifyLayout]]  # (rows, their indices, layout)

    @classmethod
    def build(cls, ks: list[int], upload: Callable[[torch.Tensor], torch.Tensor]) -> DraftPlan:
        steps = []
        for j in range(2, max(ks, default=0) + 1):
            rows = [i for i, k in enumerate(ks) if k >= j]
            layout = VerifyLayout.build([0] * len(rows), upload)
            steps.append((upload(torch.tensor(rows, dtype=torch.int64)), rows, layout))
        return cls(VerifyLayout.build([1] * len(ks), upload), steps)


class SpecDecoder:
    """The stream side of speculative decoding for one model: verify, history, proposer."""

    def __init__(self, proposer: Proposer, sampler: Sampler, fmap: FutureMap) -> None:
        self.proposer = proposer
        self.sampler = sampler
        self.fmap = fmap

    def after_extend(
        self,
        fb: ForwardBatch,
        stash_slots: torch.Tensor,
        stash_rows: torch.Tensor,
        next_ids: torch.Tensor,
        spec: SpecArgs,
    ) -> None:
        """A prefill step sampled the first token of its final rows: it joins each slot's
        history, at the prompt's end."""
        self.proposer.on_target_step(self.fmap, fb, spec)
        hist = self.fmap.history
        assert hist is not None
        if not stash_slots.numel():
            return
        ends = fb.seq_lens[stash_rows]
        hist[stash_slots, ends.clamp(max=hist.shape[1] - 1)] = next_ids[stash_rows]

    def after_decode(self, fb: ForwardBatch, next_ids: torch.Tensor, spec: SpecArgs) -> None:
        """A plain decode step (no row carried drafts): each token joins its slot's history at
        the row's new length."""
        self.proposer.on_target_step(self.fmap, fb, spec)
        hist = self.fmap.history
        assert hist is not None
        hist[fb.req_pool_indices, fb.seq_lens.clamp(max=hist.shape[1] - 1)] = next_ids

    def before_verify(self, fb: ForwardBatch, spec: SpecArgs) -> None:
        """Before the target forward of a verify step resolves its drafts."""
        self.proposer.before_verify(self.fmap, fb, spec)

    def verify(
        self, fb: ForwardBatch, logits: torch.Tensor, spec: SpecArgs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept drafts against the target's `logits` [T, V] (processed). Returns the padded
        tokens [B, max_k + 1] (accepted drafts, then the target's token; -1 after), the
        accept counts [B] and the drafts each row carried [B]; updates the device lengths, the
        last tokens, the histories and the next drafts."""
        layout = fb.verify
        fmap = self.fmap
        assert layout is not None and fmap.drafts is not None and fmap.history is not None
        assert spec.ks is not None and spec.draft_mask is not None
        slots = fb.req_pool_indices
        max_k = layout.max_k
        drafts = fmap.drafts[slots, :max_k].masked_fill(~spec.draft_mask, -1)
        padded = logits[layout.pad_index]  # [B, max_k + 1, V]
        sb = spec.sb_pad
        if sb is None or sb.all_greedy:
            accepted, tokens = _greedy_accept(padded, drafts)
        else:
            accepted, tokens = self._sampled_accept(padded, drafts, sb)
        offered = (drafts >= 0).sum(dim=1)
        last = tokens.gather(1, accepted[:, None])[:, 0]
        fmap.tokens[slots] = last
        after = fb.seq_lens  # `before + k + 1`, planned: lowered by the rejected drafts
        after.sub_(spec.ks - accepted)
        # history: the token at each row's old length was its input; the new ones follow it
        hist = fmap.history
        start = after - accepted  # old length + 1
        cols = (start[:, None] + torch.arange(max_k + 1, device=start.device)[None, :]).clamp_(
            max=hist.shape[1] - 1
        )
        hist[slots[:, None], cols] = tokens
        return tokens, accepted, offered

    def _sampled_accept(
        self, padded: torch.Tensor, drafts: torch.Tensor, sb: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, n_pos, vocab = padded.shape
        flat = padded.reshape(bsz * n_pos, vocab)
        probs = self.sampler.probs(flat, sb)
        noise = self.sampler.exponential(probs, sb)
        uniforms = self.sampler.uniforms(sb).view(bsz, n_pos)[:, : n_pos - 1]
        assert sb.temperatures is not None
        greedy = (sb.temperatures <= 0.0).view(bsz, n_pos)[:, 0]
        # greedy rows decide on the raw scores' argmax, which their probs keep
        return rejection_sample(
            probs.view(bsz, n_pos, vocab),
            greedy,
            drafts,
            None,
            uniforms,
            noise.view(bsz, n_pos, vocab),
        )


def _greedy_accept(padded: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: drafts accepted while they equal the argmax; the argmax at the
    first mismatch (or after the last draft) is the step's own token."""
    target = padded.argmax(dim=-1)  # [B, max_k + 1]
    max_k = drafts.shape[1]
    match = (drafts == target[:, :max_k]).to(torch.int64)
    accepted = match.cumprod(dim=1).sum(dim=1)
    pos = torch.arange(max_k + 1, device=target.device)[None, :]
    tokens = target.masked_fill(pos > accepted[:, None], -1)
    return accepted, tokens


class DraftModelProposer:
    """A smaller model with the target's tokenizer drafts greedily (its proposal is a point
    mass, so rejection sampling needs no draft distribution). Its KV cache has the target's
    token slots and is addressed through the same `req_to_token` rows, so every slot the host
    reserves for the target holds the draft's KV at the same position.

    Its KV follows the target's: it runs on every prefill chunk, and every decode or verify
    step starts with a two-token step that recomputes the position before each row's last
    token (the one draft a verify step that accepted every draft could not have written)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache

    def on_target_step(self, fmap: FutureMap, fb: ForwardBatch, spec: SpecArgs) -> None:
        if fb.mode is ForwardMode.DECODE:
            assert spec.draft is not None
            self._catch_up(fmap, fb, spec.draft, fb.positions, scored=False)
        else:  # KV only: no position is scored
            none = torch.empty(0, dtype=torch.int64, device=fb.positions.device)
            self.model(
                dataclasses.replace(
                    fb, kv_cache=self.kv_cache, logit_positions=None, logit_rows=none
                )
            )

    def _catch_up(
        self,
        fmap: FutureMap,
        fb: ForwardBatch,
        plan: DraftPlan,
        last_pos: torch.Tensor,
        scored: bool = True,
    ) -> torch.Tensor:
        """The two-token step at each row's `last_pos - 1` and `last_pos`; returns the draft's
        next token after the last (`scored`; else only the KV is written)."""
        history = fmap.history
        assert history is not None
        rpi, n, first = fb.req_pool_indices, fb.batch_size, plan.first
        pos = (last_pos - 1)[first.rows] + first.offsets
        ids = history[rpi[first.rows], pos]
        # only the last position's scores are needed: one output row per request, not two
        rows = torch.arange(1 if scored else 0, 2 * n if scored else 0, 2, device=pos.device)
        logits = self._forward(fb, first, n, list(range(n)), ids, pos, rpi, rows)
        return logits.argmax(dim=-1)

    def before_verify(self, fmap: FutureMap, fb: ForwardBatch, spec: SpecArgs) -> None:
        plan, layout, drafts = spec.draft, fb.verify, fmap.drafts
        assert plan is not None and layout is not None and drafts is not None
        rpi, n = fb.req_pool_indices, fb.batch_size
        last_pos = last_positions(fb)
        cur = self._catch_up(fmap, fb, plan, last_pos)
        out = torch.full((n, layout.max_k), -1, dtype=torch.int64, device=cur.device)
        if layout.max_k:
            out[:, 0] = cur
        for j, (rows, rows_cpu, step) in enumerate(plan.steps, start=2):
            sub_rpi = rpi[rows]
            pos = last_pos[rows] + (j - 1)
            logits = self._forward(fb, step, len(rows_cpu), rows_cpu, cur[rows], pos, sub_rpi)
            nxt = logits.argmax(dim=-1)
            out[rows, j - 1] = nxt
            cur = cur.index_copy(0, rows, nxt)
        drafts[rpi, : layout.max_k] = out

    def _forward(
        self,
        fb: ForwardBatch,
        layout: VerifyLayout,
        n: int,
        rows: list[int],
        ids: torch.Tensor,
        pos: torch.Tensor,
        rpi: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft forward at device positions `pos`, inside the rows' verify windows."""
        widths = fb.seq_lens_cpu[rows] if len(rows) != fb.batch_size else fb.seq_lens_cpu
        draft_fb = ForwardBatch(
            mode=ForwardMode.VERIFY,
            batch_size=n,
            input_ids=ids,
            positions=pos,
            out_cache_loc=fb.req_to_token[rpi[layout.rows], pos],
            req_pool_indices=rpi,
            seq_lens=fb.seq_lens,
            req_pool_indices_cpu=fb.req_pool_indices_cpu[rows],
            seq_lens_cpu=widths,
            extend_lens_cpu=[k + 1 for k in layout.ks],
            prefix_lens_cpu=[0] * n,
            req_to_token=fb.req_to_token,
            kv_cache=self.kv_cache,
            verify=layout,
            logit_rows=logit_rows,
        )
        logits: torch.Tensor = self.model(draft_fb)
        return logits
