"""The logits-processor protocol: one feature between the forward and the sampler.

A processor has three parts, as vLLM's `LogitsProcessor` (`apply`, `update_state`):
- `plan` (host, at launch): this step's rows that use the feature, packed into the processor's
  own plan part of uploaded tensors, from host facts only (None: no row uses it);
- `apply` (stream): the part applied to the logits, out of place; state the stream owns is
  created by the first step that needs it, and rows of (re)admitted requests are rebuilt first;
- `record` (stream, right after sampling): the sampled ids the feature remembers. With
  overlap, batch N+1 is launched before the host has seen batch N's tokens, and the FIFO
  stream records N's before N+1 applies: the host never needs them.

The executor holds the registered processors as one list (`execution/processors.py`); a verify
step runs the same list over its flattened positions, one row per scored position.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from stallfree.runtime.request.req import Req

_I64 = torch.int64
PartT = TypeVar("PartT")


@dataclass(slots=True)
class StepRows:
    """The host facts of one step's token rows (a verify step: one per scored position)."""

    reqs: list[Req]
    output_rows: list[bool]  # the row's sampled token is its request's next output
    output_steps: list[int]  # the output index that token gets


@dataclass(slots=True)
class Uploads:
    """Host lists to device tensors through the stream's `upload`."""

    upload: Callable[[torch.Tensor], torch.Tensor]

    def ints(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return self.upload(torch.tensor(values, dtype=_I64))

    def floats(self, values: list[float]) -> torch.Tensor:
        return self.upload(torch.tensor(values, dtype=torch.float32))


class LogitsProcessor(abc.ABC, Generic[PartT]):
    """One feature: `plan` on the host, `apply` and `record` on the stream (see the module)."""

    name: ClassVar[str]  # its plan part's key in `LogitsPlan.parts`

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots  # request slots: rows of any per-slot state

    @classmethod
    @abc.abstractmethod
    def plan(cls, rows: StepRows, up: Uploads) -> PartT | None:
        """This step's part for the rows that use the feature, or None when none does."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, part: PartT, raw: torch.Tensor) -> torch.Tensor:
        """`raw`: the logits before any processor ran."""

    def record(self, part: PartT, next_ids: torch.Tensor) -> None:
        """Nothing to remember by default."""
