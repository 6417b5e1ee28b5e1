"""Plug-ins are found by name; the core never imports them."""

from __future__ import annotations

import pytest

from stallfree import Engine
from stallfree.hisparse import HisparseCoordinator
from stallfree.metrics import EngineMetrics
from stallfree.runtime import plugins
from stallfree.runtime.telemetry.observer import MetricsExporter
from tests.engine_util import engine_config


def test_builtin_plugins_come_from_entry_points():
    assert isinstance(plugins.load_metrics_plugin("prometheus").build, object)
    sparse = plugins.load_sparse_attention_plugin("hisparse")
    assert type(sparse).__module__ == "stallfree.hisparse.plugin"


def test_a_missing_or_malformed_plugin_is_a_clear_error(monkeypatch):
    with pytest.raises(plugins.PluginError, match=r"no 'stallfree\.metrics' plug-in named 'nope'"):
        plugins.load_metrics_plugin("nope")
    monkeypatch.setitem(plugins._registered, (plugins.METRICS_GROUP, "bad"), object())
    with pytest.raises(plugins.PluginError, match="lacks build"):
        plugins.load_metrics_plugin("bad")


async def test_a_registered_metrics_plugin_replaces_prometheus_and_reads_the_snapshot(monkeypatch):
    class Lines(MetricsExporter):
        def __init__(self, snapshot) -> None:
            self.snapshot = snapshot
            self.tokens = 0

        def on_tokens(self, req, count, now) -> None:
            self.tokens += count

        def render(self) -> bytes:
            return f"generated {self.snapshot().counters.generation_tokens}".encode()

    class LinesPlugin:
        def build(self, config, snapshot) -> Lines:
            return Lines(snapshot)

    monkeypatch.setitem(plugins._registered, (plugins.METRICS_GROUP, "prometheus"), LinesPlugin())
    async with Engine(engine_config("tiny")) as engine:
        await engine.complete([1, 2, 3], {"max_new_tokens": 5, "ignore_eos": True})
        assert isinstance(engine.metrics, Lines) and not isinstance(engine.metrics, EngineMetrics)
        assert engine.metrics.render() == b"generated 5"
        assert engine.metrics.tokens == 5


async def test_hisparse_is_installed_through_the_sparse_attention_seam():
    cfg = engine_config("tiny", hisparse={"enabled": True, "top_k": 8, "device_buffer_size": 16})
    async with Engine(cfg) as engine:
        assert isinstance(engine.core.ctx.sparse, HisparseCoordinator)
        await engine.complete(list(range(40)), {"max_new_tokens": 4, "ignore_eos": True})
        await engine.wait_idle()
        snap = engine.snapshot()
    assert snap.sparse is not None and snap.sparse.all_free
    assert snap.sparse.host_pool_total > 0
    async with Engine(engine_config("tiny")) as dense:
        assert dense.core.ctx.sparse is None and dense.snapshot().sparse is None
