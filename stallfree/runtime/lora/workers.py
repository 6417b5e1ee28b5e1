"""The adapter slots of a model that lives in worker processes (`runtime.worker=process`,
tensor parallelism): the host keeps no weights, so a slot's write rides in the next step
message to the workers, where every rank cuts the whole adapter to its own shards
(`model/lora.py: LoraSlots.write`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.model.llama import LlamaForCausalLM
from stallfree.runtime.model.loader import causal_lm
from stallfree.runtime.model.lora import Weights, target_shapes


@dataclass(slots=True, eq=False)
class WorkerSlots:
    """`shapes`: the whole model's adaptable projections, (in, out) by (layer, target), which
    an adapter is checked against on the host; `journal`: the host's import journal, which
    the next step message carries to every rank (`BatchContext.import_journal`)."""

    shapes: dict[tuple[int, str], tuple[int, int]]
    journal: list[tuple[Any, ...]]

    @classmethod
    def for_arch(cls, arch: ModelArchConfig, journal: list[tuple[Any, ...]]) -> WorkerSlots:
        """The shapes read off the whole model built on the meta device (no weights), as the
        workers build each rank's."""
        meta: LlamaForCausalLM = causal_lm(arch)(arch, device=torch.device("meta"))
        return cls(target_shapes(meta), journal)

    def write(self, slot: int, weights: Weights) -> None:
        """Slot `slot` holds this adapter from the next step on, on every rank.
        NOTE: steps sent before read the slot's old weights, as on an in-process stream."""
        self.journal.append(("lora", slot, weights))
