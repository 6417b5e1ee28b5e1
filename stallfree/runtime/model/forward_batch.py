"""What one launched step hands the model: device tensors plus immutable host metadata.

Device tensors are only touched by work enqueued on the stream. The `_cpu` fields are host
copies taken at schedule time; the model uses them for shapes and loops, never the device.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stallfree.runtime.memory.pool import KVCache


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    # speculative verify: each request's last token and its drafts, at positions the device
    # decides (its own length); shapes and widths come from host upper bounds
    VERIFY = "verify"
    IDLE = "idle"


@dataclass(slots=True)
class VerifyLayout:
    """A verify step's layout, decided on the host: row `b` carries `ks[b]` drafts after its
    last token (`ks[b] + 1` tokens), padded to `max_k + 1` positions per row.

    `pad_index` [B, max_k + 1] (device): the flat token each padded position reads (a row's
    last token repeated past its own); `flat_pos` [T] (device): each flat token's padded
    position `b * (max_k + 1) + j`.
    """

    ks: list[int]
    max_k: int
    pad_index: torch.Tensor
    flat_pos: torch.Tensor
    rows: torch.Tensor  # [T] device: each flat token's batch row
    offsets: torch.Tensor  # [T] device: each flat token's offset j in its row

    @classmethod
    def build(cls, ks: list[int], upload: Callable[[torch.Tensor], torch.Tensor]) -> VerifyLayout:
        """From the host's draft counts, uploaded."""
        i64 = torch.int64
        ns = [k + 1 for k in ks]
        max_k = max(ks, default=0)
        rows = torch.repeat_interleave(
            torch.arange(len(ks), dtype=i64), torch.tensor(ns, dtype=i64)
        )
        offsets = (
            torch.cat([torch.arange(m, dtype=i64) for m in ns]) if ns else torch.empty(0, dtype=i64)
        )
        pad, start = [], 0
        for k, m in zip(ks, ns, strict=True):
            pad.append([start + min(j, k) for j in range(max_k + 1)])
            start += m
        pad_index = torch.tensor(pad, dtype=i64).reshape(len(ks), max_k + 1)
        return cls(
            ks=list(ks),
            max_k=max_k,
            pad_index=upload(pad_index),
            flat_pos=upload(rows * (max_k + 1) + offsets),
            rows=upload(rows),
            offsets=upload(offsets),
        )


@dataclass(slots=True, eq=False)
class LoraBatch:
    """One step's token rows by adapter slot (model/lora.py): `slots`, the slots in use;
    `token_groups` (device [T]), each token's index in `slots` (-1: the base model); and
    `groups`, `(slot, rows)` per slot, `rows` a device index of its tokens (None: every
    token of the step)."""

    slots: list[int]
    slot_index: torch.Tensor  # device [len(slots)]: `slots`
    token_groups: torch.Tensor
    groups: list[tuple[int, torch.Tensor | None]]
    # the stream's per-dtype masks of `token_groups` at a rank (model/lora.py)
    masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        slots: list[int],
        tokens: list[int],
        upload: Callable[[torch.Tensor], torch.Tensor],
    ) -> LoraBatch | None:
        """From each row's slot (-1: the base model) and token count; None when no row has an
        adapter."""
        if all(s < 0 for s in slots):
            return None
        used = sorted({s for s in slots if s >= 0})
        index = {s: i for i, s in enumerate(used)}
        per_token = [index.get(s, -1) for s, n in zip(slots, tokens, strict=True) for _ in range(n)]
        token_groups = upload(torch.tensor(per_token, dtype=torch.int64))
        slot_index = upload(torch.tensor(used, dtype=torch.int64))
        if len(set(slots)) == 1:
            return cls(used, slot_index, token_groups, [(slots[0], None)])
        by_slot: dict[int, list[int]] = {}
        start = 0
        for slot, n in zip(slots, tokens, strict=True):
            if slot >= 0:
                by_slot.setdefault(slot, []).extend(range(start, start + n))
            start += n
        groups: list[tuple[int, torch.Tensor | None]] = [
            (s, upload(torch.tensor(rows, dtype=torch.int64))) for s, rows in by_slot.items()
        ]
        return cls(used, slot_index, token_groups, groups)


@dataclass(slots=True)
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    # device tensors
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64: length after this step
    # host metadata
    req_pool_indices_cpu: torch.Tensor  # [B] int64
    seq_lens_cpu: torch.Tensor  # [B] int64
    extend_lens_cpu: list[int]  # new tokens per request (1 in decode)
    prefix_lens_cpu: list[int]  # tokens already in the cache per request
    # shared state
    req_to_token: torch.Tensor  # [num_req_slots, max_context] int64, device
    kv_cache: KVCache
    # original prompt length per request: a re-prefill after retraction also carries outputs
    prompt_lens_cpu: list[int] = field(default_factory=list)
    # a sparse-attention plug-in's plan for this step, opaque to the core (see runtime/execution/sparse.py)
    sparse_plan: object = None
    # device [N] int64: flat token offsets whose logits the model also returns, after the last
    # tokens' rows (prompt logprobs); None: only the last tokens'
    logit_positions: torch.Tensor | None = None
    # VERIFY only: the padded layout of the rows (None otherwise)
    verify: VerifyLayout | None = None
    # device [N] int64: the only flat token rows whose logits are returned (a draft model's
    # steps that need one position, or none, of each row); None: as the mode says
    logit_rows: torch.Tensor | None = None
    # LoRA: the step's token rows by adapter slot (model/lora.py); None: the base model only
    lora: LoraBatch | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_cpu.max()) if self.batch_size else 0
