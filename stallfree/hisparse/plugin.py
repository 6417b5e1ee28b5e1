"""The HiSparse plug-in the engine loads (entry point `stallfree.sparse_attention:hisparse`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from stallfree.hisparse.attention import HisparseAttention
from stallfree.hisparse.coordinator import HisparseCoordinator, resolve_sparse_layers
from stallfree.runtime.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from stallfree.config import HisparseConfig
    from stallfree.runtime.execution.context import BatchContext
    from stallfree.runtime.model.arch import ModelArchConfig


class HisparsePlugin:
    def capacity_ratio(self, config: HisparseConfig, arch: ModelArchConfig) -> float:
        resolve_sparse_layers(config, arch)  # raises HisparseConfigError on a bad layer choice
        return config.host_to_device_ratio

    def install(
        self, config: HisparseConfig, arch: ModelArchConfig, ctx: BatchContext, model: nn.Module
    ) -> HisparseCoordinator:
        """Build the coordinator, drop the dense KV of sparse layers, wrap the attention."""
        if not isinstance(model, LlamaForCausalLM):
            raise TypeError(f"HiSparse needs a LlamaForCausalLM, not {type(model).__name__}")
        coordinator = HisparseCoordinator(config, resolve_sparse_layers(config, arch), ctx)
        coordinator.release_dense_kv()
        model.attn_backend = HisparseAttention(coordinator, model.attn_backend)
        return coordinator


PLUGIN = HisparsePlugin()
