"""Plug-ins: the core names what it needs, plug-ins provide it, and the core never imports them.

A plug-in is found by name, first among those registered in this process, then among the
package entry points of its group (`stallfree.sparse_attention`, `stallfree.metrics`), the way
installed packages extend serving engines. stallfree's own HiSparse and Prometheus plug-ins are
declared as entry points in its `pyproject.toml`.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

    from stallfree.config import HisparseConfig, StallfreeConfig
    from stallfree.runtime.execution.context import BatchContext
    from stallfree.runtime.execution.sparse import SparseAttention
    from stallfree.runtime.model.arch import ModelArchConfig
    from stallfree.runtime.telemetry.observer import MetricsExporter
    from stallfree.runtime.telemetry.stats import EngineSnapshot

SPARSE_ATTENTION_GROUP = "stallfree.sparse_attention"
METRICS_GROUP = "stallfree.metrics"


class PluginError(LookupError):
    """A configured plug-in is not installed, or does not provide what its group requires."""


@runtime_checkable
class SparseAttentionPlugin(Protocol):
    def capacity_ratio(self, config: HisparseConfig, arch: ModelArchConfig) -> float:
        """Validate `config` for `arch`; return how many more tokens than the device budget the
        engine can hold (KV kept on the host)."""
        ...

    def install(
        self, config: HisparseConfig, arch: ModelArchConfig, ctx: BatchContext, model: nn.Module
    ) -> SparseAttention:
        """Wrap the model's attention and return the hooks the batch ops will call."""
        ...


@runtime_checkable
class MetricsPlugin(Protocol):
    def build(
        self, config: StallfreeConfig, snapshot: Callable[[], EngineSnapshot]
    ) -> MetricsExporter: ...


_registered: dict[tuple[str, str], object] = {}


def register_plugin(group: str, name: str, plugin: object) -> None:
    """Make `plugin` available under `name` in this process (it wins over entry points)."""
    _registered[(group, name)] = plugin


def _find(group: str, name: str) -> object:
    plugin = _registered.get((group, name))
    if plugin is not None:
        return plugin
    found = entry_points(group=group, name=name)
    if not found:
        raise PluginError(
            f"no {group!r} plug-in named {name!r} is installed "
            "(stallfree's own are declared as entry points: install the package)"
        )
    return next(iter(found)).load()


def load_sparse_attention_plugin(name: str) -> SparseAttentionPlugin:
    plugin = _find(SPARSE_ATTENTION_GROUP, name)
    if not isinstance(plugin, SparseAttentionPlugin):
        raise PluginError(f"{SPARSE_ATTENTION_GROUP} plug-in {name!r} lacks capacity_ratio/install")
    return plugin


def load_metrics_plugin(name: str) -> MetricsPlugin:
    plugin = _find(METRICS_GROUP, name)
    if not isinstance(plugin, MetricsPlugin):
        raise PluginError(f"{METRICS_GROUP} plug-in {name!r} lacks build")
    return plugin
