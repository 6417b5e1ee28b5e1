"""HiSparse: host-offloaded top-k sparse attention whose coordinator consumes host indices."""

from __future__ import annotations

from stallfree.hisparse.attention import HisparseAttention
from stallfree.hisparse.coordinator import (
    STALL_SITE,
    HisparseConfigError,
    HisparseCoordinator,
    HisparseUsage,
    resolve_sparse_layers,
)
from stallfree.hisparse.oracle import TopkOracleAttention, topk_reference_row
from stallfree.hisparse.plugin import PLUGIN, HisparsePlugin

__all__ = [
    "PLUGIN",
    "STALL_SITE",
    "HisparseAttention",
    "HisparseConfigError",
    "HisparseCoordinator",
    "HisparsePlugin",
    "HisparseUsage",
    "TopkOracleAttention",
    "resolve_sparse_layers",
    "topk_reference_row",
]
