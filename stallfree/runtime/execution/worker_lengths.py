"""A worker's own record of each request slot's length, from which it places decode and
verify steps.

The host plans a step from its replica of the device state (`ProcessStream` runs the planned
device ops on host tensors at once). A verify step lowers its rows' lengths by the drafts it
rejected, on the workers' stream; with overlap the host has planned the next step before that
step's answer is in, so its replica's lengths (and the positions, columns and KV slots drawn
from them) may be too long by the drafts in flight. The workers hold the lengths as the
in-process stream does: an extend step sets a slot's length (the host's values are exact
there), and a decode or verify step's positions, lengths and verify window slots are drawn
here from the slot's recorded length, in stream order, as the in-process ops draw them from
the device tensors. Each verify answer carries the lengths it left, so the host can bring its
replica of that step's tensor up to date.
"""

from __future__ import annotations

import torch

from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode


class DeviceLengths:
    def __init__(self, num_req_slots: int, device: torch.device) -> None:
        self.lens = torch.zeros(num_req_slots, dtype=torch.int64, device=device)

    def place(self, fb: ForwardBatch) -> None:
        """Before the step's table writes: a decode or verify step's positions and lengths
        from each slot's recorded length (the message's are the host replica's)."""
        if fb.mode is ForwardMode.DECODE:
            before = self.lens[fb.req_pool_indices]
            fb.positions = before
            fb.seq_lens = before + 1
        elif fb.mode is ForwardMode.VERIFY:
            layout = fb.verify
            assert layout is not None
            before = self.lens[fb.req_pool_indices]
            fb.positions = before[layout.rows] + layout.offsets
            ns = torch.tensor(fb.extend_lens_cpu, dtype=torch.int64, device=before.device)
            fb.seq_lens = before + ns

    def record(self, fb: ForwardBatch) -> torch.Tensor | None:
        """After the step: each row's length as it left it (a verify step's, lowered by its
        rejected drafts, is returned for the host's replica)."""
        if fb.mode is ForwardMode.IDLE or not fb.batch_size:
            return None
        self.lens[fb.req_pool_indices] = fb.seq_lens
        return fb.seq_lens if fb.mode is ForwardMode.VERIFY else None


def locate(fb: ForwardBatch, table: torch.Tensor) -> None:
    """After a step's table writes: a decode step writes its own entries at its positions
    (the host does not journal them); a verify step's KV slots are its window's entries at its
    positions."""
    rpi = fb.req_pool_indices
    if fb.mode is ForwardMode.DECODE:
        table[rpi, fb.positions] = fb.out_cache_loc
    elif fb.mode is ForwardMode.VERIFY:
        assert fb.verify is not None
        fb.out_cache_loc = table[rpi[fb.verify.rows], fb.positions]
