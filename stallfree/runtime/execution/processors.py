"""The registered logits processors, in the order they apply, and the executor's list of them.

Adding a processor: its own module (a `LogitsProcessor`, `execution/logits_processor.py`) and
one line in `PROCESSORS`.
"""

from __future__ import annotations

from typing import Any

import torch

from stallfree.runtime.execution.bad_words import BadWords
from stallfree.runtime.execution.grammar_masks import Grammar
from stallfree.runtime.execution.logit_bias import LogitBias
from stallfree.runtime.execution.logits_processor import LogitsProcessor, StepRows, Uploads
from stallfree.runtime.execution.penalties import Penalties

# bias and masks, the allowed tokens, the longer bad words, penalties, then the grammar's mask
PROCESSORS: tuple[type[LogitsProcessor[Any]], ...] = (LogitBias, BadWords, Penalties, Grammar)


def plan_parts(rows: StepRows, up: Uploads) -> dict[str, Any]:
    """Host side: each processor's part of the step's plan, for those some row uses."""
    parts = {}
    for cls in PROCESSORS:
        part = cls.plan(rows, up)
        if part is not None:
            parts[cls.name] = part
    return parts


class LogitsProcessors:
    """The stream side of every registered processor, each with the state it owns."""

    def __init__(self, num_slots: int) -> None:
        self.processors = [cls(num_slots) for cls in PROCESSORS]

    def apply(self, logits: torch.Tensor, parts: dict[str, Any]) -> torch.Tensor:
        """Stream side: the planned processors in order, out of place (the raw logits stay as
        they were, for logprobs)."""
        raw = logits
        for processor in self.processors:
            part = parts.get(processor.name)
            if part is not None:
                logits = processor.apply(logits, part, raw)
        return logits

    def record(self, parts: dict[str, Any], next_ids: torch.Tensor) -> None:
        """Stream side, right after sampling: what each planned processor remembers."""
        for processor in self.processors:
            part = parts.get(processor.name)
            if part is not None:
                processor.record(part, next_ids)
