"""Turning LoRA on for an engine: the model's projections wrapped (`model/lora.py`), and the
registry that names adapters and fills their slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stallfree.config import StallfreeConfig
from stallfree.overlap.stream import DeviceStream
from stallfree.runtime.lora.registry import LoraRegistry
from stallfree.runtime.model import lora as model_lora
from stallfree.runtime.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from stallfree.runtime.model.loader import LoadedModel


def build_lora(
    config: StallfreeConfig, loaded: LoadedModel | None, stream: DeviceStream
) -> LoraRegistry | None:
    """The registry of an engine with `lora.enable_lora` (None without); the adapters of
    `lora.lora_modules` are loaded by `Engine.start`."""
    cfg = config.lora
    if not cfg.enable_lora:
        return None
    if loaded is None or not isinstance(loaded.model, LlamaForCausalLM):
        raise ValueError(
            "LoRA adapters need a native decoder family in process (Llama, Qwen2/3, Mistral, "
            "Phi-3, Gemma); not the transformers fallback or worker processes"
        )
    table = model_lora.install(loaded.model, cfg.max_loras, cfg.max_lora_rank, loaded.dtype)
    served = config.server.model_name(config.model.path)
    names = tuple(dict.fromkeys((served, config.model.path, loaded.name)))
    return LoraRegistry(table, stream, cfg, loaded.dtype, names)
