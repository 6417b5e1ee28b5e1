"""`create_app`: the FastAPI app, its lifespan, error handlers and API-key check."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from stallfree.config import StallfreeConfig
from stallfree.entrypoints.server.api.disagg import Disaggregated, disagg_routes
from stallfree.entrypoints.server.api.routes import api_routes, open_routes
from stallfree.entrypoints.server.api.utility import utility_routes
from stallfree.entrypoints.server.base.errors import (
    ApiError,
    api_error_json,
    count_refusal,
    describe_validation,
    error_json,
    from_invalid_request,
)
from stallfree.entrypoints.server.base.generation_defaults import load_generation_defaults
from stallfree.entrypoints.server.base.protocol import ErrorInfo
from stallfree.entrypoints.server.base.state import Lifecycle, ServerState
from stallfree.entrypoints.server.chat.tools import template_ignores_tools
from stallfree.entrypoints.server.intake.screening import close_screening
from stallfree.entrypoints.server.output.tracing import RequestTracer
from stallfree.entrypoints.server.transport.guard import Guard
from stallfree.metrics.engine_metrics import EngineMetrics
from stallfree.metrics.operator import ServerMetrics
from stallfree.runtime.engine import Engine
from stallfree.runtime.pooler import open_engine
from stallfree.runtime.request.errors import InvalidRequestError

logger = logging.getLogger("stallfree.server")


def create_app(engine_or_config: Engine | StallfreeConfig, freeze_heap: bool = False) -> FastAPI:
    """An app serving `engine_or_config`; the lifespan starts the engine (and, when the app
    built it from a config, drains and shuts it down).

    `freeze_heap`, for a process that is only this server (`serve`): once the engine has
    started, what the process holds moves out of the garbage collector's sight (`gc.freeze`)
    and the collector is on (`serve` starts with it off),
    so a full collection walks only what requests made since. Without it, a collection that a
    large request's objects set off walks the whole model stack too: one 4 MB chat body held
    `/health` 190 ms, 50 ms frozen."""
    owns = not isinstance(engine_or_config, Engine)
    engine = (
        engine_or_config if isinstance(engine_or_config, Engine) else open_engine(engine_or_config)
    )
    app = FastAPI(
        title="stallfree",
        lifespan=_lifespan(engine, owns, freeze_heap),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    lifecycle = Lifecycle()
    app.state.sf = _server_state(engine, lifecycle)
    metrics = app.state.sf.metrics
    _install_error_handlers(app, metrics)
    _include_routes(app, engine.config)
    _add_middleware(app, engine.config, lifecycle, metrics)
    return app


def _lifespan(
    engine: Engine, owns: bool, freeze_heap: bool
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: start the engine (and the disaggregation side when it is on), and
    on the way out stop them, flush the tracer, and shut the engine down when the app owns it."""
    cfg = engine.config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        _warn_if_template_ignores_tools(engine)
        disagg = Disaggregated.for_engine(engine) if cfg.disaggregation.enabled else None
        if disagg is not None:
            await disagg.start()
            app.state.sf.disagg = disagg
        if freeze_heap:
            # one full pass, then out of its sight; `serve` ran its start-up with the collector
            # off (cli.py), and it is on from here
            gc.collect()
            gc.freeze()
            gc.enable()
        try:
            yield
        finally:
            if disagg is not None:
                await disagg.stop()
            await asyncio.to_thread(close_screening)
            tracer = app.state.sf.tracer
            if tracer is not None:
                await asyncio.to_thread(tracer.shutdown)  # sends the spans still queued
            if owns:
                try:
                    await engine.shutdown(drain=True)
                except Exception as exc:
                    # the engine logged how it died when it did; one line is enough here
                    logger.error("engine shutdown failed: %r", exc)

    return lifespan


def _warn_if_template_ignores_tools(engine: Engine) -> None:
    if template_ignores_tools(engine.tokenizer):
        # a warning where tools are meant to be used (a tool-call parser is set); a note
        # otherwise, and each request that sends tools is warned of anyway
        logger.log(
            logging.WARNING if engine.config.server.tool_call_parser else logging.INFO,
            "this model's chat template does not use `tools`: tools a chat request sends "
            "stay out of the prompt (a forced tool_choice still constrains the reply to "
            "them); --chat-template sets one that does",
        )


def _server_state(engine: Engine, lifecycle: Lifecycle) -> ServerState:
    """What the routes read from `app.state.sf`: the engine, the served name, the server
    settings, the lifecycle, the server's metrics and tracer, and the generation defaults."""
    cfg = engine.config
    exporter = engine.metrics
    metrics = (
        ServerMetrics(exporter.registry, exporter.labels, engine.max_context_len)
        if isinstance(exporter, EngineMetrics)
        else None
    )
    tracer = None
    if cfg.server.otlp_traces_endpoint is not None:
        tracer = RequestTracer(cfg.server.otlp_traces_endpoint)
        engine.add_observer(tracer)
    return ServerState(
        engine,
        cfg.server.model_name(cfg.model.path),
        cfg.server,
        lifecycle,
        metrics=metrics,
        tracer=tracer,
        defaults=load_generation_defaults(
            cfg.server.generation_config, cfg.model.path, engine.tokenizer.eos_token_ids
        ),
    )


def _include_routes(app: FastAPI, cfg: StallfreeConfig) -> None:
    app.include_router(open_routes())
    # the API key is checked by the Guard on the request head, before any body is read
    app.include_router(api_routes())
    app.include_router(utility_routes())
    if cfg.disaggregation.enabled:
        app.include_router(disagg_routes())


def _add_middleware(
    app: FastAPI, cfg: StallfreeConfig, lifecycle: Lifecycle, metrics: ServerMetrics | None
) -> None:
    app.add_middleware(Guard, limits=cfg.server, lifecycle=lifecycle, metrics=metrics)
    if cfg.server.allowed_origins:
        # outside the Guard: a preflight (OPTIONS, no API key) is answered here, and every
        # answer the Guard gives (401, 413, 503) carries the CORS headers a browser needs
        # to read it
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cfg.server.allowed_origins,
            allow_methods=cfg.server.allowed_methods,
            allow_headers=cfg.server.allowed_headers,
            allow_credentials=cfg.server.allow_credentials,
        )
    if metrics is not None:
        # outermost: the HTTP families see the Guard's own answers (401, 413, 503) too
        metrics.instrument(app)


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics | None) -> None:
    def counted(status: int, info: ErrorInfo) -> None:
        count_refusal(metrics, status, info.code)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        counted(exc.status, exc.info)
        return api_error_json(exc)

    async def invalid_request(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InvalidRequestError)
        err = from_invalid_request(exc)
        counted(err.status, err.info)
        return api_error_json(err)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = describe_validation(exc.errors())
        info = ErrorInfo(message=message, type="invalid_request_error", param=param)
        counted(400, info)
        return error_json(400, info)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        info = ErrorInfo(message=str(exc.detail), type="invalid_request_error")
        counted(exc.status_code, info)
        return error_json(exc.status_code, info)

    app.add_exception_handler(ApiError, api_error)
    # the engine's request checks (`Engine.check_prompt`) raise this from the routes
    app.add_exception_handler(InvalidRequestError, invalid_request)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
