"""Every setting of stallfree, as pydantic models."""

from stallfree.config.disagg import DisaggregationConfig
from stallfree.config.faults import FaultConfig
from stallfree.config.lora import LoraConfig, LoraModule
from stallfree.config.settings import (
    CacheConfig,
    HisparseConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    StallfreeConfig,
    load_config,
)

__all__ = [
    "CacheConfig",
    "DisaggregationConfig",
    "FaultConfig",
    "HisparseConfig",
    "LoraConfig",
    "LoraModule",
    "MetricsConfig",
    "ModelConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "StallfreeConfig",
    "load_config",
]
