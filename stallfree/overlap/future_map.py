"""The future map (token relay): sampled ids handed from batch N to N+1 on the stream.

It is indexed by request slot. Batch N stashes the ids of the requests that produced a real
token; batch N+1 resolves a decode request's input id from its slot, all in stream order, so
no token makes a host round trip before it is fed back.

Debug mode (on with `runtime.check_mirrors`) checks every resolve against the stash it should
read, as SGLang's future map does. Each stash gets a generation number, decided on the host at
launch: the host keeps, per slot, the generation of the stash that is pending (not yet
resolved), and the device keeps a stamp per slot that the stash op writes next to the token.
A decode row whose slot has no pending stash fails at launch, on the host; a row whose device
stamp is not the generation the host expects (a stash that was lost, reordered, or written by
row instead of by slot) fails the step on the stream, naming the slots.

With speculative decoding (`enable_spec`) the map also holds, per slot, the drafts the
proposer wrote for the slot's next verify step (`drafts`, -1 where there is none) and the
slot's token history (`history`: prompt and outputs by position, the proposer's input). Both
are written and read on the stream only; the host never reads a draft to build a batch.
"""

from __future__ import annotations

import torch

_NEVER = -1


class FutureMapError(RuntimeError):
    """A decode step resolves a request slot that no step stashed a token for."""


class FutureMap:
    def __init__(self, num_req_slots: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_req_slots, dtype=torch.int64, device=device)
        self.debug = False
        self.stamps: torch.Tensor | None = None
        self._pending: dict[int, int] = {}  # host: slot -> generation of its unresolved stash
        self._generation = 0
        self.drafts: torch.Tensor | None = None  # [slots, k] speculative drafts, -1: none
        self.history: torch.Tensor | None = None  # [slots, max_context + 1] tokens by position

    def enable_spec(self, max_k: int, history_len: int) -> None:
        """Speculative decoding: room for `max_k` drafts and a token history per slot."""
        slots, device = self.tokens.shape[0], self.tokens.device
        self.drafts = torch.full((slots, max_k), -1, dtype=torch.int64, device=device)
        self.history = torch.zeros((slots, history_len), dtype=torch.int64, device=device)

    def state(self) -> list[torch.Tensor]:
        """Every device tensor of the map (the stream owns them)."""
        out = [self.tokens]
        out += [t for t in (self.stamps, self.drafts, self.history) if t is not None]
        return out

    def enable_debug(self) -> None:
        if not self.debug:
            self.debug = True
            self.stamps = torch.full_like(self.tokens, _NEVER)

    # ------------------------------------------------------------------ host side (launch)

    def plan_prefill(self, slots: list[int]) -> None:
        """Rows of an extend batch: whatever an earlier user of the slot stashed is stale."""
        for s in slots:
            self._pending.pop(s, None)

    def plan_resolve(self, slots: list[int]) -> list[int]:
        """Rows of a decode batch consume their pending stash; returns the generations to check."""
        pending = self._pending
        missing = [s for s in slots if s not in pending]
        if missing:
            raise FutureMapError(
                f"decode resolves request slot(s) {missing} from the future map, but no step "
                "stashed a token there since the slot was last resolved or prefilled"
            )
        return [pending.pop(s) for s in slots]

    def plan_stash(self, slots: list[int]) -> int:
        """The stash of these slots, about to be enqueued; returns its generation."""
        self._generation += 1
        gen = self._generation
        for s in slots:
            self._pending[s] = gen
        return gen

    # ------------------------------------------------------------------ stream side

    def resolve(
        self, req_pool_indices: torch.Tensor, expected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Runs on the stream: the pending input id of each request slot.

        `expected` (debug): the generation each row's stash must carry.
        """
        if expected is not None and self.stamps is not None:
            self._check(req_pool_indices, self.stamps[req_pool_indices], expected)
        return self.tokens[req_pool_indices]

    def stash(
        self,
        slots: torch.Tensor,
        rows: torch.Tensor,
        next_ids: torch.Tensor,
        generation: int | None = None,
    ) -> None:
        """Runs on the stream: `tokens[slots] = next_ids[rows]`.

        Only rows that produced a real token are stashed; an intermediate prefill chunk is not,
        so it cannot overwrite a pending first decode token.
        """
        if slots.numel():
            self.tokens[slots] = next_ids[rows]
        self.mark(slots, generation)

    def verify_inputs(
        self, slots: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Runs on the stream: a verify step's flat input ids. Token `t` of batch row
        `rows[t]` is the slot's last token at offset 0 and its draft `offsets[t] - 1` after;
        a missing draft (-1) reads as token 0, whose scores no accepted token depends on."""
        assert self.drafts is not None
        flat_slots = slots[rows]
        last = self.tokens[flat_slots]
        drafts = self.drafts[flat_slots, (offsets - 1).clamp_(min=0)]
        return torch.where(offsets == 0, last, drafts.clamp(min=0))

    def mark(self, slots: torch.Tensor, generation: int | None) -> None:
        """Runs on the stream (debug): stamp `slots` with `generation`.

        A step that failed before its stash still marks its slots, so the next step's check
        does not fail too: those requests are failed, and their tokens are never used.
        """
        if generation is not None and self.stamps is not None and slots.numel():
            self.stamps[slots] = generation

    @staticmethod
    def _check(slots: torch.Tensor, stamps: torch.Tensor, expected: torch.Tensor) -> None:
        if slots.device.type != "cpu":
            torch._assert_async(
                (stamps == expected).all(), "future map resolve of a slot not stashed for this step"
            )
            return
        bad = (stamps != expected).nonzero().flatten().tolist()
        if bad:
            detail = ", ".join(
                f"slot {int(slots[i])} holds stash {int(stamps[i])}, wants {int(expected[i])}"
                for i in bad[:8]
            )
            raise FutureMapError(
                f"future map resolve of a slot not stashed for this step: {detail}"
            )
