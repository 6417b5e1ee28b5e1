"""What an operator reads beside the engine's families, on the same registry (the one `/metrics`
renders):

- the HTTP requests by handler, method and status, counted and timed by
  `prometheus-fastapi-instrumentator` (what vLLM uses), `/metrics` and `/health` left out; the
  labels come from fixed sets the server chooses (the app's route templates, the methods HTTP
  defines), so no client input creates a series: any other path is `none`, any other method
  `other`;
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
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from stallfree.metrics.histogram import one_two_five_buckets
from stallfree.metrics.names import BASE_LABELS, PREFIX, REFUSAL_REASONS

if TYPE_CHECKING:
    from prometheus_fastapi_instrumentator.metrics import Info
    from starlette.applications import Starlette

    from stallfree.config import StallfreeConfig
    from stallfree.runtime.telemetry.stats import EngineSnapshot

# routes the HTTP families leave out: the probes, scraped and polled far more than the API
UNINSTRUMENTED = ("/metrics", "/health")
# vLLM's buckets for `n`
N_BUCKETS = (1, 2, 5, 10, 20)
HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# the `method` label's values: the methods HTTP defines (RFC 9110, and PATCH); any other method a
# client makes up is `OTHER_METHOD`
HTTP_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)
OTHER_METHOD = "other"
# the `handler` label of a path no route matches (the instrumentator's and vLLM's value)
NO_ROUTE = "none"


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
            instrumentator.add(_bounded_labels(instrumentation, app))
        instrumentator.instrument(app)


def _bounded_labels(instrumentation: Any, app: Starlette) -> Callable[[Info], None]:
    """`instrumentation` with its `method` and `handler` labels held to fixed sets.

    The instrumentator labels a request with the method the client sent, whatever it is, and,
    for a path one slash away from a route's, with the path itself: each made-up method or path
    would be a new series of every HTTP family (about 20 each; a 60 KB method name 60 KB in each
    of them). Here a method outside `HTTP_METHODS` is `other`, and a handler that is not one of
    `app`'s route templates is `none`."""
    templates: frozenset[str] | None = None

    def record(info: Info) -> None:
        nonlocal templates
        if templates is None:  # on the first request: every route is in place by then
            templates = frozenset(_route_templates(app.routes))
        if info.method not in HTTP_METHODS:
            info.method = OTHER_METHOD
        if info.modified_handler not in templates:
            info.modified_handler = NO_ROUTE
        instrumentation(info)

    return record


def _route_templates(routes: Iterable[Any], prefix: str = "") -> Iterable[str]:
    """The path templates of `routes`, through FastAPI's included routers and mounts."""
    for route in routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if callable(contexts):  # an included router (FastAPI >= 0.116)
            for context in contexts():
                inner = getattr(context, "starlette_route", None) or context
                yield from _route_templates([inner], prefix)
            continue
        path = getattr(route, "path", None)
        if not isinstance(path, str):
            continue
        yield prefix + path
        inner_routes = getattr(route, "routes", None)
        if inner_routes:  # a mount
            yield from _route_templates(inner_routes, prefix + path)
