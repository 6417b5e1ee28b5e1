"""The field groups `ScheduleBatch._assign` takes: a device tensor with its mirror, the per-row
host lists, the per-token tensors of one step; the names of the fields only it may set; and
the order retraction takes a batch's rows in."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from stallfree.runtime.request.req import Req

_I64 = torch.int64


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=_I64)


class _Keep(enum.Enum):
    KEEP = "keep"


KEEP = _Keep.KEEP
"""An operation leaves this group of fields as it is (it says so; it does not forget it)."""


class Mirrored(NamedTuple):
    """A device tensor and its CPU mirror: set together or not at all."""

    device: torch.Tensor
    host: torch.Tensor


class RowLists(NamedTuple):
    """Per-row host facts of the step the batch was last prepared for."""

    prefix_lens: list[int]
    extend_lens: list[int]
    output_rows: list[bool]  # rows whose sampled token is real
    output_steps: list[int]  # output index each row's token will have (seeded sampling)

    @classmethod
    def empty(cls) -> RowLists:
        return cls([], [], [], [])

    def select(self, keep: list[int]) -> RowLists:
        return RowLists(
            [self.prefix_lens[i] for i in keep],
            [self.extend_lens[i] for i in keep],
            [self.output_rows[i] for i in keep],
            [self.output_steps[i] for i in keep],
        )

    def concat(self, other: RowLists) -> RowLists:
        return RowLists(
            self.prefix_lens + other.prefix_lens,
            self.extend_lens + other.extend_lens,
            self.output_rows + other.output_rows,
            self.output_steps + other.output_steps,
        )


class StepTensors(NamedTuple):
    """Per-token device tensors of one prepared step. Filter and merge clear them."""

    out_cache_loc: torch.Tensor
    input_ids: torch.Tensor | None  # None in decode: resolved from the future map
    positions: torch.Tensor | None


# the fields `_assign` owns; no other method may assign them (a test reads the source)
ASSIGNED_FIELDS = (
    "reqs",
    "req_pool_indices",
    "req_pool_indices_cpu",
    "seq_lens",
    "seq_lens_cpu",
    "committed_lens_cpu",
    "prefix_lens_cpu",
    "extend_lens_cpu",
    "output_rows",
    "output_steps",
    "out_cache_loc",
    "input_ids",
    "positions",
)


def retract_order(reqs: list[Req]) -> list[int]:
    """Rows in the order retraction takes them: fewest outputs, then the longest prompt."""
    return sorted(
        range(len(reqs)),
        key=lambda i: (len(reqs[i].output_ids), -len(reqs[i].origin_input_ids)),
    )
