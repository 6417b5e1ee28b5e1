"""`serve`'s own rows of the flag table beside the engine's: `serve MODEL`, where the server
listens and who may call it, what one request may ask of it, and its logs."""

from __future__ import annotations

from stallfree.entrypoints.flags import (
    LOG_LEVELS,
    SWITCH,
    Table,
    flag,
    name_list,
    positive_int,
    positive_seconds,
)

# fmt: off
# (the tables are laid out one row per flag: the names and what the flag sets, then its help)
_API = [
    flag("--host", help="bind address", sets="server.host"),
    flag("--port", type=int, help="TCP port; 0 picks a free one", sets="server.port"),
    flag("--api-key", metavar="KEY", action="append", sets="server.api_key",
         unset="none: the API is open",
         help="require 'Authorization: Bearer KEY' on the API routes (an empty key is refused); "
         "repeat it to accept any of several keys"),
    flag("--served-model-name", metavar="NAME", sets="server.served_model_name",
         unset="the model path", help="model id in the API and the metrics"),
    flag("--generation-config", metavar="auto|vllm|DIR", sets="server.generation_config",
         help="sampling defaults for fields a request leaves unset: auto reads the model's "
         "generation_config.json, vllm ignores it, or a directory holding one"),
    flag("--tokenizer", metavar="PATH", sets="model.tokenizer", unset="the model's own",
         help="the tokenizer and its chat template from another directory, .gguf file or Hub "
         "id than the model's"),
    flag("--chat-template", metavar="TEMPLATE", sets="server.chat_template", unset="the model's",
         help="chat template of /v1/chat/completions instead of the model's own: a Jinja file, "
         "or the template text itself"),
    flag("--enable-auto-tool-choice", action="store_const", const=True,
         sets="server.enable_auto_tool_choice",
         help="let the model decide when to call a tool (tool_choice auto); needs "
         "--tool-call-parser"),
    flag("--tool-call-parser", choices=["hermes", "llama3_json", "mistral", "pythonic"],
         sets="server.tool_call_parser", unset="none",
         help="how the model writes tool calls, parsed into message.tool_calls"),
    flag("--reasoning-parser", choices=["deepseek_r1", "qwen3"], sets="server.reasoning_parser",
         unset="none", help="split the model's <think>...</think> into message.reasoning_content"),
    flag("--seed", dest="model_seed", type=int, metavar="SEED", sets="model.seed",
         help="seed of preset weights and of unseeded sampling"),
    flag("--metrics", **SWITCH, help="Prometheus metrics at /metrics", sets="metrics.enabled"),
    flag("--enable-prompt-tokens-details", action="store_true",
         help="accepted for vLLM's command lines and does nothing: usage.prompt_tokens_details "
         "(cached_tokens, the prompt tokens the prefix cache served) is always reported"),
    flag("--structured-outputs-strict", **SWITCH, sets="runtime.structured_outputs_strict",
         help="JSON schemas (response_format, structured_outputs, tools) allow only the "
         "properties and tuple items they name unless they say otherwise, as vLLM's default "
         "backend reads them; --no-structured-outputs-strict: JSON schema's own default"),
    flag("--grammar-cache-bytes", type=int, metavar="BYTES", sets="runtime.grammar_cache_bytes",
         help="compiled structured-output grammars kept for reuse, capped by their estimated "
         "size (least recently used out first); 0 keeps none"),
]
# TLS, CORS, a proxy's path prefix, a Unix socket and tracing (vLLM's spellings)
_TRANSPORT = [
    *(flag(name, metavar="FILE", help=text, sets=f"server.{name[2:].replace('-', '_')}",
           unset="none")
      for name, text in (
          ("--ssl-keyfile", "TLS private key file (PEM)"),
          ("--ssl-certfile", "TLS certificate chain file (PEM)"),
          ("--ssl-ca-certs", "CA certificates client certificates are checked with"),
      )),
    flag("--ssl-cert-reqs", type=int, choices=(0, 1, 2), sets="server.ssl_cert_reqs",
         help="client certificates: 0 not asked for, 1 optional, 2 required"),
    *(flag(name, type=name_list, metavar="LIST", sets=f"server.{name[2:].replace('-', '_')}",
           help=f"{text}: a JSON list or comma-separated names")
      for name, text in (
          ("--allowed-origins", "CORS origins allowed ('*': any)"),
          ("--allowed-methods", "CORS methods an allowed origin may use"),
          ("--allowed-headers", "CORS headers an allowed origin may send"),
      )),
    flag("--allow-credentials", **SWITCH, sets="server.allow_credentials",
         help="CORS: allowed origins may send credentials"),
    flag("--root-path", metavar="PATH", sets="server.root_path", unset="none",
         help="path prefix a proxy strips (e.g. /llm)"),
    flag("--uds", metavar="PATH", sets="server.uds", unset="none",
         help="serve on this Unix domain socket instead of host and port"),
    flag("--otlp-traces-endpoint", metavar="URL", sets="server.otlp_traces_endpoint",
         unset="none: no tracing",
         help="export a span tree per request to this OpenTelemetry collector (OTLP/HTTP)"),
]
# what one request may ask of the server, how long a client may leave a response unread, and
# how long an idle connection is kept (the other limits are settings only)
_LIMITS = [
    flag("--max-request-cost", type=positive_int, metavar="ENTRIES",
         sets="server.max_request_cost",
         help="token entries one /v1 request's answer may hold (a token with k top logprobs is "
         "k + 1): per prompt n x max_tokens x (k + 1), plus its tokens once, or n x (k + 1) "
         "times when echoed; more is a 400 before any generation"),
    flag("--max-chat-messages", type=positive_int, metavar="N", sets="server.max_chat_messages",
         help="messages one /v1/chat/completions request may hold"),
    flag("--max-content-parts", type=positive_int, metavar="N", sets="server.max_content_parts",
         help="content parts one /v1/chat/completions request may hold, over all its messages"),
    flag("--write-timeout", dest="write_timeout_s", type=positive_seconds, metavar="SECONDS",
         sets="server.write_timeout_s",
         help="a connection whose client accepts no byte of a response for this long is reset "
         "and its requests aborted"),
    flag("--timeout-keep-alive", dest="keep_alive_s", type=positive_seconds, metavar="SECONDS",
         sets="server.keep_alive_s",
         help="an idle keep-alive connection is closed after this; keep it above how long "
         "clients' pools keep idle connections (httpx 5 s, aiohttp 15 s, Go and reqwest 90 s)"),
]
# the server's, uvicorn's, the access and the request logs
_LOGS = [
    flag("--log-level", choices=LOG_LEVELS, sets="server.log_level",
         help="level of the server's and the engine's logs"),
    flag("--uvicorn-log-level", choices=LOG_LEVELS, sets="server.uvicorn_log_level",
         unset="--log-level's", help="level of uvicorn's own logs only"),
    flag("--access-log", **SWITCH, sets="server.access_log",
         help="one log line per HTTP request (/health and /metrics never, unless "
         "server.access_log_probes)"),
    flag("--disable-uvicorn-access-log", dest="access_log", action="store_const", const=False,
         help="turn the access log off, as --no-access-log does (vLLM's spelling; default: on)"),
    flag("--enable-log-requests", dest="log_requests", action="store_const", const=True,
         sets="runtime.log_requests", help="log each request's arrival and finish at INFO"),
    flag("--disable-log-requests", dest="log_requests", action="store_const", const=False,
         help="do not log each request (the default; vLLM's spelling)"),
]
SERVER_FLAGS: Table = (
    (None, [flag("model_tag", nargs="?", metavar="MODEL",
                 help="the model, as with --model (vLLM's `serve MODEL`)")]),
    ("server", _API),
    ("transport (TLS, CORS, proxy, Unix socket)", _TRANSPORT),
    ("server", _LIMITS + _LOGS),
)
# fmt: on
