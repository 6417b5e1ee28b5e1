"""The `stallfree` command line."""

# NOTE: the docstring above is the parser's description; `stallfree.cli` adds `bench` to it

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from stallfree.config import StallfreeConfig, load_config


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose and size the engine (shared by `generate`, `serve` and `bench`)."""
    p.add_argument("--model", help="HF model directory or preset (tiny, bench-cpu)")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--cpu-mirrors", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--page-size", type=int)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-prefill-tokens", type=int)
    p.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV of common prefixes (default: on, off with HiSparse)",
    )
    p.add_argument(
        "--disable-radix-cache",
        dest="prefix_caching",
        action="store_const",
        const=False,
        help="the same as --no-enable-prefix-caching (SGLang's spelling)",
    )
    p.add_argument(
        "--schedule-policy", choices=["fcfs", "lpm"], help="admission order (default fcfs)"
    )


def config_from_args(args: argparse.Namespace) -> StallfreeConfig:
    overrides: dict[str, dict[str, Any]] = {
        "model": {},
        "runtime": {},
        "cache": {},
        "scheduler": {},
        "server": {},
        "metrics": {},
    }
    pairs = {
        "model": ("model", "path"),
        "device": ("runtime", "device"),
        "overlap": ("runtime", "overlap"),
        "cpu_mirrors": ("runtime", "cpu_mirrors"),
        "page_size": ("cache", "page_size"),
        "max_total_tokens": ("cache", "max_total_tokens"),
        "max_running_requests": ("cache", "max_running_requests"),
        "chunked_prefill_size": ("scheduler", "chunked_prefill_size"),
        "max_prefill_tokens": ("scheduler", "max_prefill_tokens"),
        "prefix_caching": ("cache", "prefix_caching"),
        "schedule_policy": ("scheduler", "policy"),
        "host": ("server", "host"),
        "port": ("server", "port"),
        "api_key": ("server", "api_key"),
        "served_model_name": ("server", "served_model_name"),
        "log_level": ("server", "log_level"),
        "access_log": ("server", "access_log"),
        "metrics": ("metrics", "enabled"),
    }
    for flag, (section, key) in pairs.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[section][key] = value
    return load_config(args.config, **{k: v for k, v in overrides.items() if v})


async def _generate(args: argparse.Namespace) -> int:
    from stallfree.runtime.engine import Engine
    from stallfree.runtime.sampling_params import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    async with Engine(config_from_args(args)) as engine:
        async for chunk in engine.generate(args.prompt, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            if chunk.finished:
                sys.stdout.write("\n")
                print(
                    f"[{chunk.finish_reason}: {chunk.prompt_tokens} prompt + "
                    f"{chunk.completion_tokens} completion tokens]",
                    file=sys.stderr,
                )
                if chunk.error:
                    print(f"error: {chunk.error}", file=sys.stderr)
                    return 1
    return 0


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8000)")
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on the API routes (an empty key is refused)",
    )
    p.add_argument("--served-model-name", help="model id in the API and metrics")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="level of the server's and the engine's logs (default info)",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one log line per HTTP request (default on; /health and /metrics never, unless "
        "server.access_log_probes)",
    )


def _serve(args: argparse.Namespace) -> int:
    from stallfree.entrypoints.server import serve

    # NOTE: 0 after a drained shutdown (SIGTERM or SIGINT); 1 if the engine died
    return serve(config_from_args(args))


def run_async(coro: Any) -> int:
    """Run `coro` to completion on uvloop (asyncio without it); its result is an exit code."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return int(asyncio.run(coro))
    # NOTE: only the import is guarded: an ImportError raised by the command itself propagates
    return int(uvloop.run(coro))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one completion")
    add_engine_flags(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    srv = sub.add_parser("serve", help="run the HTTP server (OpenAI-compatible API, /metrics)")
    add_engine_flags(srv)
    _add_server_flags(srv)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_async(_generate(args))
        if args.command == "serve":
            return _serve(args)
    except ValidationError as exc:
        print(f"stallfree: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"stallfree: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
