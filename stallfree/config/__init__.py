"""Every setting of stallfree, as pydantic models."""

from stallfree.config.settings import (
    CacheConfig,
    HisparseConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
    StallfreeConfig,
    load_config,
)

__all__ = [
    "CacheConfig",
    "HisparseConfig",
    "ModelConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "StallfreeConfig",
    "load_config",
]
