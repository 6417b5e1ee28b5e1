"""Every setting of stallfree, as pydantic models."""

from stallfree.config.settings import (
    CacheConfig,
    FaultConfig,
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
    "FaultConfig",
    "HisparseConfig",
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
