"""The `server` section (`stallfree serve`: where it listens, who may call it, what one request
may ask of it, and its logs) and the `metrics` section."""

from __future__ import annotations

from pathlib import PurePath
from typing import Literal

from pydantic import Field, field_validator, model_validator

from stallfree.config.sections import Section as _Section

# How long an HTTP server of ours (the API, the router, a prefill's bootstrap endpoint) keeps
# an idle keep-alive connection: past how long clients' pools keep theirs (httpx 5 s, aiohttp
# 15 s, nginx's upstream pools 60 s, Go's and hyper's, so reqwest's and the Rust routers', 90 s),
# so a client never sends on a connection the server is closing at that moment (the request is
# lost unanswered: a reset, no log line)
KEEP_ALIVE_S = 120


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="Bind address; loopback unless set")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one")
    api_key: str | list[str] | None = Field(
        None,
        description="Bearer token(s) the HTTP API requires, if set: one key, or a list of which "
        "any one is accepted",
    )
    served_model_name: str | None = Field(
        None,
        description="Model id in the API and the metrics; default: model.path, or a GGUF "
        "file's name without its directory",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template of /v1/chat/completions instead of the model's own: a Jinja "
        "file, or the template text itself",
    )
    graceful_shutdown_s: float = Field(
        30.0,
        ge=0,
        allow_inf_nan=False,
        description="On SIGTERM or SIGINT, how long in-flight requests may take to finish",
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest request body; a larger one gets 413 before it is read whole",
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description="Open connections; past it the longest-idle one is closed (or the new one, "
        "if none is idle). Capped below the process's open-file limit",
    )
    max_concurrent_requests: int = Field(
        4096,
        ge=1,
        description="API requests in progress at once; more get 503 with Retry-After "
        "(/health and /metrics are exempt)",
    )
    keep_alive_s: float = Field(
        KEEP_ALIVE_S,
        gt=0,
        allow_inf_nan=False,
        description="Idle keep-alive connections close after this; keep it above the clients' "
        "pools' idle time",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="A request's line and headers must arrive whole within this, counted from "
        "the connection's opening or the request's first byte; slower connections are closed",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="A request body must arrive whole within this (408 otherwise)",
    )
    screening_timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="A dense body (one parsed in the screening process) must be checked within "
        "this once its turn comes; past it the request is a 503 and the process is replaced",
    )
    write_timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="A connection whose client accepts no byte of a response for this long "
        "(its write buffer full and not draining) is reset and its requests aborted",
    )
    max_prompts_per_request: int = Field(
        128, ge=1, description="Prompts one /v1/completions request may batch (400 beyond)"
    )
    max_request_cost: int = Field(
        1_000_000,
        ge=1,
        description="Token entries one /v1 request's answer may hold (a token with k top "
        "logprobs is k + 1): per prompt n x max_tokens x (k + 1), plus its tokens once, or n x "
        "(k + 1) times when echoed; 400 request_too_costly beyond, before any generation",
    )
    max_chat_messages: int = Field(
        4096, ge=1, description="Messages one /v1/chat/completions request may hold (400 beyond)"
    )
    max_content_parts: int = Field(
        4096,
        ge=1,
        description="Content parts and tool calls one /v1/chat/completions request may hold, "
        "over all its messages (400 beyond)",
    )
    retry_after_s: int = Field(
        1, ge=0, description="Retry-After (seconds) of a 503 answered because of overload"
    )
    allowed_hosts: list[str] | None = Field(
        None,
        description="Host header values (without port) the server answers; others get 400. "
        "Default: any. Set it when binding beyond loopback",
    )
    root_path: str = Field(
        "",
        description="Path prefix a proxy in front strips before forwarding (ASGI root_path); "
        "default: none",
    )
    uds: str | None = Field(
        None, description="Serve on this Unix domain socket instead of host and port"
    )
    ssl_keyfile: str | None = Field(None, description="TLS private key file (PEM); default: no TLS")
    ssl_certfile: str | None = Field(
        None, description="TLS certificate chain file (PEM); default: no TLS"
    )
    ssl_ca_certs: str | None = Field(
        None, description="CA certificates (PEM) that client certificates are checked against"
    )
    ssl_cert_reqs: int = Field(
        0,
        ge=0,
        le=2,
        description="Client certificates: 0 not asked for, 1 optional, 2 required (Python's "
        "ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="CORS: origins browsers may call the API from ('*': any); default: none, "
        "and no CORS headers at all",
    )
    allowed_methods: list[str] = Field(
        default_factory=lambda: ["*"], description="CORS: methods an allowed origin may use"
    )
    allowed_headers: list[str] = Field(
        default_factory=lambda: ["*"],
        description="CORS: request headers an allowed origin may send",
    )
    allow_credentials: bool = Field(
        False, description="CORS: let an allowed origin send cookies and Authorization"
    )
    generation_config: str = Field(
        "auto",
        description="Sampling defaults for fields a request leaves unset: auto reads the model "
        "directory's generation_config.json, vllm ignores it, or a directory holding one",
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="Let the model decide when to call a tool (tool_choice auto, the default "
        "when a request sends tools); needs tool_call_parser",
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(
        None,
        description="How the model writes tool calls, parsed into message.tool_calls; default: "
        "none (tool_choice required and named functions still work)",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None,
        description="Split the model's thinking (<think>...</think>) into "
        "message.reasoning_content; default: none, all of it is content",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector (OTLP/HTTP) that gets one span tree per request, "
        "e.g. http://localhost:4318; default: no tracing",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info", description="Level of the server's and the engine's logs"
    )
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] | None = (
        Field(None, description="Level of uvicorn's own logs only; default: server.log_level")
    )
    access_log: bool = Field(True, description="Log one line per HTTP request")
    access_log_probes: bool = Field(
        False, description="Also access-log /health and /metrics (probes and scrapes)"
    )

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is None:
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("the list of API keys is empty; pass at least one key, or none")
            return [cls._one_key(k) for k in v]
        return cls._one_key(v)

    @model_validator(mode="after")
    def _tls(self) -> ServerConfig:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both ssl_keyfile and ssl_certfile; one was given")
        if self.ssl_certfile is None and (self.ssl_ca_certs or self.ssl_cert_reqs):
            raise ValueError("ssl_ca_certs and ssl_cert_reqs apply only with TLS (ssl_certfile)")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("checking client certificates (ssl_cert_reqs) needs ssl_ca_certs")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"root_path must start with '/': {self.root_path!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice needs tool_call_parser (which format to parse)"
            )
        return self

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every accepted key (none: the API is open)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)

    @staticmethod
    def _one_key(v: str) -> str:
        if not v:
            raise ValueError(
                "the API key is empty, which would leave the API open; pass a non-empty key, "
                "or none at all to serve without authentication"
            )
        if not v.isascii() or not v.isprintable() or any(c.isspace() for c in v):
            raise ValueError("the API key must be printable ASCII without spaces")
        return v

    def model_name(self, model_path: str) -> str:
        """The served model id: `served_model_name`, else the model as given, but for a GGUF
        file its name alone (the directory it sits in is the server's own business)."""
        if self.served_model_name:
            return self.served_model_name
        if model_path.lower().endswith(".gguf"):
            return PurePath(model_path).name
        return model_path


class MetricsConfig(_Section):
    enabled: bool = Field(True, description="Attach Prometheus metrics to every engine")
    engine_label: str | None = Field(
        None, description="Value of the `engine` label; default: a per-process counter"
    )
