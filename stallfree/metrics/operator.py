"""What an operator reads beside the engine's families, on the same registry (the one `/metrics`
renders):

- the HTTP requests by handler, method and status, counted and timed by
  `prometheus-fastapi-instrumentator` (what vLLM uses), `/metrics` and `/health` left out;
- prometheus-client's process, platform and garbage-collector collectors (`process_*`,
  `python_info`, `python_gc_*`);
- the requests the server refused, by reason, each reason at 0 from the start;
- vLLM's request-parameter histograms (`request_params_n`, `request_params_max_tokens`);
- the engine's configuration info metric (`config_info_labels`, exported by `EngineMetrics`).

Several servers on one registry share one set of families, each server's series under its own
`model_name` and `engine` labels.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from stallfree.metrics.histogram import one_two_five_buckets
from stallfree.metrics.names import BASE_LABELS, PREFIX, REFUSAL_REASONS

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from stallfree.config import StallfreeConfig
    from stallfree.runtime.telemetry.stats import EngineSnapshot

# routes the HTTP families leave out: the probes, scraped and polled far more than the API
UNINSTRUMENTED = ("/metrics", "/health")
# vLLM's buckets for `n`
N_BUCKETS = (1, 2, 5, 10, 20)
HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def config_info_labels(config: StallfreeConfig, snap: EngineSnapshot) -> dict[str, str]:
    """The configuration a dashboard is read against, as the info metric's labels (vLLM's
    `cache_config_info`): the version, the overlap and mirror modes, the KV page size and
    slots, the weights' dtype, the tensor-parallel size, HiSparse and speculation."""
    from stallfree import __version__

    runtime = config.runtime
    return {
        "version": __version__,
        "overlap": str(runtime.overlap).lower(),
        "cpu_mirrors": str(runtime.cpu_mirrors).lower(),
        "page_size": str(config.cache.page_size),
        "kv_slots": str(snap.pools.kv_tokens_total),
        "dtype": snap.dtype,
        "tp_size": str(config.parallel.tp_size),
        "hisparse": str(config.hisparse.enabled).lower(),
        "speculative": config.speculative.method,
    }


class _Families:
    """One registry's server families (prometheus-client refuses a name twice in a registry)."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int) -> None:
        labels = [*BASE_LABELS]
        self.refusals = Counter(
            PREFIX + "http_refusals",
            "Requests the server refused before running them, by reason.",
            [*labels, "reason"],
            registry=registry,
        )
        self.params_n = Histogram(
            PREFIX + "request_params_n",
            "The n (choices per prompt) of each request.",
            labels,
            buckets=N_BUCKETS,
            registry=registry,
        )
        self.params_max_tokens = Histogram(
            PREFIX + "request_params_max_tokens",
            "The max_tokens of each request (what the server allowed when the client sent none).",
            labels,
            buckets=one_two_five_buckets(max_model_len),
            registry=registry,
        )
        if registry is not REGISTRY:  # the global one has them already
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.http: tuple[object, object] | None = None


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


class ServerMetrics:
    """The server's families for one engine's labels; `refused` and `observe_params` are called
    once per request, off the engine's hot path."""

    def __init__(
        self, registry: CollectorRegistry, labels: tuple[str, str], max_model_len: int
    ) -> None:
        families = _families.get(registry)
        if families is None:
            families = _families[registry] = _Families(registry, max_model_len)
        self.registry = registry
        self._families = families
        self._refusals = {
            reason: families.refusals.labels(*labels, reason) for reason in REFUSAL_REASONS
        }
        self._n = families.params_n.labels(*labels)
        self._max_tokens = families.params_max_tokens.labels(*labels)

    def refused(self, reason: str) -> None:
        self._refusals[reason].inc()

    def observe_params(self, n: int, max_tokens: int) -> None:
        self._n.observe(n)
        self._max_tokens.observe(max_tokens)

    def instrument(self, app: Starlette) -> None:
        """Count and time `app`'s HTTP requests on this registry. Add it after the app's other
        middleware, so that it is the outermost and sees the answers they give themselves."""
        from prometheus_fastapi_instrumentator import Instrumentator, metrics

        families = self._families
        if families.http is None:
            # the instrumentations register their families, so a registry makes them once
            families.http = (
                metrics.requests(
                    metric_name=PREFIX + "http_requests_total",
                    metric_doc="HTTP requests by handler, method and status class.",
                    registry=self.registry,
                ),
                metrics.latency(
                    metric_name=PREFIX + "http_request_duration_seconds",
                    metric_doc="HTTP request time, to the last byte, by handler, method and "
                    "status class.",
                    buckets=HTTP_LATENCY_BUCKETS,
                    registry=self.registry,
                ),
            )
        instrumentator = Instrumentator(
            excluded_handlers=list(UNINSTRUMENTED), registry=self.registry
        )
        for instrumentation in families.http:
            instrumentator.add(instrumentation)  # type: ignore[arg-type]
        instrumentator.instrument(app)
