"""`serve`'s own flags beside the engine's: `serve MODEL`, where the server listens and who may
call it, what one request may ask of it, and its logs."""

from __future__ import annotations

import argparse
import json

from stallfree.entrypoints.flags import LOG_LEVELS, flag_help, positive_seconds


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """`serve`'s flags beside the engine's: `serve MODEL`, the API and the logs."""
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as with --model (vLLM's `serve MODEL`)",
    )
    g = p.add_argument_group("server")
    _add_api_flags(g)
    _add_transport_flags(p.add_argument_group("transport (TLS, CORS, proxy, Unix socket)"))
    _add_limit_flags(g)
    _add_log_flags(g)


def _add_api_flags(g: argparse._ArgumentGroup) -> None:
    """Where the server listens, who may call it, and what it answers with."""
    g.add_argument("--host", help=flag_help("bind address", "server", "host"))
    g.add_argument(
        "--port", type=int, help=flag_help("TCP port; 0 picks a free one", "server", "port")
    )
    g.add_argument(
        "--api-key",
        metavar="KEY",
        action="append",
        help=flag_help(
            "require 'Authorization: Bearer KEY' on the API routes (an empty key is refused); "
            "repeat it to accept any of several keys",
            "server",
            "api_key",
            "none: the API is open",
        ),
    )
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        help=flag_help(
            "model id in the API and the metrics", "server", "served_model_name", "the model path"
        ),
    )
    g.add_argument(
        "--generation-config",
        metavar="auto|vllm|DIR",
        help=flag_help(
            "sampling defaults for fields a request leaves unset: auto reads the model's "
            "generation_config.json, vllm ignores it, or a directory holding one",
            "server",
            "generation_config",
        ),
    )
    g.add_argument(
        "--chat-template",
        metavar="TEMPLATE",
        help=flag_help(
            "chat template of /v1/chat/completions instead of the model's own: a Jinja file, or "
            "the template text itself",
            "server",
            "chat_template",
            "the model's",
        ),
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_const",
        const=True,
        help=flag_help(
            "let the model decide when to call a tool (tool_choice auto); needs --tool-call-parser",
            "server",
            "enable_auto_tool_choice",
        ),
    )
    g.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral", "pythonic"],
        help=flag_help(
            "how the model writes tool calls, parsed into message.tool_calls",
            "server",
            "tool_call_parser",
            "none",
        ),
    )
    g.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        help=flag_help(
            "split the model's <think>...</think> into message.reasoning_content",
            "server",
            "reasoning_parser",
            "none",
        ),
    )
    g.add_argument(
        "--seed",
        dest="model_seed",
        type=int,
        metavar="SEED",
        help=flag_help("seed of preset weights and of unseeded sampling", "model", "seed"),
    )
    g.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=flag_help("Prometheus metrics at /metrics", "metrics", "enabled"),
    )


def _add_transport_flags(g: argparse._ArgumentGroup) -> None:
    """TLS, CORS, a proxy's path prefix, a Unix socket and tracing (vLLM's spellings)."""
    for flag, key, text in (
        ("--ssl-keyfile", "ssl_keyfile", "TLS private key file (PEM)"),
        ("--ssl-certfile", "ssl_certfile", "TLS certificate chain file (PEM)"),
        ("--ssl-ca-certs", "ssl_ca_certs", "CA certificates client certificates are checked with"),
    ):
        g.add_argument(flag, metavar="FILE", help=flag_help(text, "server", key, "none"))
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 1, 2),
        help=flag_help(
            "client certificates: 0 not asked for, 1 optional, 2 required",
            "server",
            "ssl_cert_reqs",
        ),
    )
    for flag, key, text in (
        ("--allowed-origins", "allowed_origins", "CORS origins allowed ('*': any)"),
        ("--allowed-methods", "allowed_methods", "CORS methods an allowed origin may use"),
        ("--allowed-headers", "allowed_headers", "CORS headers an allowed origin may send"),
    ):
        g.add_argument(
            flag,
            type=_name_list,
            metavar="LIST",
            help=flag_help(f"{text}: a JSON list or comma-separated names", "server", key),
        )
    g.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=flag_help("CORS: allowed origins may send credentials", "server", "allow_credentials"),
    )
    g.add_argument(
        "--root-path",
        metavar="PATH",
        help=flag_help("path prefix a proxy strips (e.g. /llm)", "server", "root_path", "none"),
    )
    g.add_argument(
        "--uds",
        metavar="PATH",
        help=flag_help(
            "serve on this Unix domain socket instead of host and port", "server", "uds", "none"
        ),
    )
    g.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help=flag_help(
            "export a span tree per request to this OpenTelemetry collector (OTLP/HTTP)",
            "server",
            "otlp_traces_endpoint",
            "none: no tracing",
        ),
    )


def _name_list(text: str) -> list[str]:
    """vLLM's JSON list (`'["https://a.example"]'`), or names separated by commas."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({exc.msg})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return value


def _add_limit_flags(g: argparse._ArgumentGroup) -> None:
    """What one request may ask of the server, and how long a client may leave a response
    unread (the other limits are settings only)."""
    g.add_argument(
        "--max-request-cost",
        type=_positive_int,
        metavar="ENTRIES",
        help=flag_help(
            "token entries one /v1 request's answer may hold (a token with k top logprobs is "
            "k + 1): per prompt n x max_tokens x (k + 1), plus its tokens once, or n x (k + 1) "
            "times when echoed; more is a 400 before any generation",
            "server",
            "max_request_cost",
        ),
    )
    g.add_argument(
        "--max-chat-messages",
        type=_positive_int,
        metavar="N",
        help=flag_help(
            "messages one /v1/chat/completions request may hold", "server", "max_chat_messages"
        ),
    )
    g.add_argument(
        "--max-content-parts",
        type=_positive_int,
        metavar="N",
        help=flag_help(
            "content parts one /v1/chat/completions request may hold, over all its messages",
            "server",
            "max_content_parts",
        ),
    )
    g.add_argument(
        "--write-timeout",
        dest="write_timeout_s",
        type=positive_seconds,
        metavar="SECONDS",
        help=flag_help(
            "a connection whose client accepts no byte of a response for this long is reset "
            "and its requests aborted",
            "server",
            "write_timeout_s",
        ),
    )


def _add_log_flags(g: argparse._ArgumentGroup) -> None:
    """The server's, uvicorn's, the access and the request logs."""
    g.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help=flag_help("level of the server's and the engine's logs", "server", "log_level"),
    )
    g.add_argument(
        "--uvicorn-log-level",
        choices=LOG_LEVELS,
        help=flag_help(
            "level of uvicorn's own logs only", "server", "uvicorn_log_level", "--log-level's"
        ),
    )
    g.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=flag_help(
            "one log line per HTTP request (/health and /metrics never, unless "
            "server.access_log_probes)",
            "server",
            "access_log",
        ),
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        dest="access_log",
        action="store_const",
        const=False,
        help="turn the access log off, as --no-access-log does (vLLM's spelling; default: on)",
    )
    g.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_const",
        const=True,
        help=flag_help("log each request's arrival and finish at INFO", "runtime", "log_requests"),
    )
    g.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_const",
        const=False,
        help="do not log each request (the default; vLLM's spelling)",
    )
