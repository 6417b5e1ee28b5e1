"""Llama-family models over a paged KV cache."""

from __future__ import annotations

from stallfree.runtime.model.arch import ModelArchConfig, ModelLoadError
from stallfree.runtime.model.attention import PagedAttention
from stallfree.runtime.model.llama import AttentionBackend, LlamaForCausalLM
from stallfree.runtime.model.loader import PRESETS, LoadedModel, load_model

__all__ = [
    "PRESETS",
    "AttentionBackend",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelArchConfig",
    "ModelLoadError",
    "PagedAttention",
    "load_model",
]
