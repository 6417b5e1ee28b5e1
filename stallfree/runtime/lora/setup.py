"""Turning LoRA on for an engine: the model's projections wrapped (`model/lora.py`) in this
process or, when the model lives in worker processes, by each worker (`lora/workers.py`), and
the registry that names adapters and fills their slots."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stallfree.config import StallfreeConfig
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.lora.registry import LoraRegistry, SlotTable
from stallfree.runtime.lora.workers import WorkerSlots
from stallfree.runtime.model import lora as model_lora
from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from stallfree.runtime.model.loader import LoadedModel


def build_lora(
    config: StallfreeConfig,
    loaded: LoadedModel | None,
    ctx: BatchContext,
    arch: ModelArchConfig,
    dtype: torch.dtype,
) -> LoraRegistry | None:
    """The registry of an engine with `lora.enable_lora` (None without); the adapters of
    `lora.lora_modules` are loaded by `Engine.start`. `loaded` is None when the model lives
    in worker processes (they wrap their own projections: `WorkerSpec.lora`)."""
    cfg = config.lora
    if not cfg.enable_lora:
        return None
    table: SlotTable
    if loaded is None and ctx.import_journal is not None:
        table = WorkerSlots.for_arch(arch, ctx.import_journal)
        name = Path(config.model.path).name
    elif loaded is not None and isinstance(loaded.model, LlamaForCausalLM):
        table = model_lora.install(loaded.model, cfg.max_loras, cfg.max_lora_rank, dtype)
        name = loaded.name
    else:
        raise ValueError(
            "LoRA adapters need a native decoder family (Llama, Qwen2/3, Mistral, Phi-3, "
            "Gemma); not the transformers fallback"
        )
    served = config.server.model_name(config.model.path)
    names = tuple(dict.fromkeys((served, config.model.path, name)))
    return LoraRegistry(table, ctx.stream, cfg, dtype, names)
