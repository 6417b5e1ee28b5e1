"""HiSparse: host-offloaded top-k sparse attention whose coordinator consumes host indices."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stallfree.hisparse.attention import HisparseAttention
from stallfree.hisparse.coordinator import (
    STALL_SITE,
    HisparseConfigError,
    HisparseCoordinator,
    HisparseStats,
    HisparseUsage,
    resolve_sparse_layers,
)
from stallfree.hisparse.oracle import TopkOracleAttention, topk_reference_row

if TYPE_CHECKING:
    from collections.abc import Sequence

    from stallfree.config import HisparseConfig
    from stallfree.runtime.model.llama import LlamaForCausalLM
    from stallfree.runtime.schedule_batch import BatchContext


def install_hisparse(
    config: HisparseConfig, sparse_layers: Sequence[int], ctx: BatchContext, model: LlamaForCausalLM
) -> HisparseCoordinator:
    """Build the coordinator, hand it to `ctx`, and wrap the model's attention backend."""
    coordinator = HisparseCoordinator(config, sparse_layers, ctx)
    coordinator.release_dense_kv()
    model.attn_backend = HisparseAttention(coordinator, model.attn_backend)
    ctx.hisparse = coordinator
    return coordinator


__all__ = [
    "STALL_SITE",
    "HisparseAttention",
    "HisparseConfigError",
    "HisparseCoordinator",
    "HisparseStats",
    "HisparseUsage",
    "TopkOracleAttention",
    "install_hisparse",
    "resolve_sparse_layers",
    "topk_reference_row",
]
