"""The `stallfree` command line."""

# the docstring above is the parser's description; `stallfree.cli` adds `bench` to it

from __future__ import annotations

import argparse
import asyncio
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from stallfree.config import StallfreeConfig, load_config
from stallfree.entrypoints.disagg_flags import add_disaggregation_flags, disaggregation_settings
from stallfree.entrypoints.flags import HelpFormatter, add_engine_flags, add_sampling_flags

# the tests import the token-count type from here, where it was defined
from stallfree.entrypoints.flags import token_count as token_count
from stallfree.entrypoints.router.flags import (
    RouterHelpFormatter,
    add_router_flags,
    router_settings,
)
from stallfree.entrypoints.server_flags import add_server_flags
from stallfree.entrypoints.spec_flags import (
    add_speculative_flags,
    check_speculative_flags,
    speculative_settings,
)

# what each command needs beyond the base install, and the extra that brings it
SERVER_MODULES = ("fastapi", "uvicorn", "jinja2")
ROUTER_MODULES = ("fastapi", "uvicorn", "httpx")


def missing_module(names: Sequence[str]) -> str | None:
    """The first of `names` that cannot be imported (its extra is not installed), or None."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def needs_extra(command: str, extra: str, modules: Sequence[str]) -> bool:
    """Say on stderr, in one line, that `command` needs `extra` when one of `modules` is
    missing; True when it is."""
    missing = missing_module(modules)
    if missing is None:
        return False
    print(
        f"{command} needs the {extra} extra ({missing} is not installed): "
        f"pip install 'stallfree[{extra}]'",
        file=sys.stderr,
    )
    return True


def _model(args: argparse.Namespace) -> str | None:
    """The model named by `serve MODEL` or by `--model`; both at once must agree."""
    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"two models given: {tag} and --model {flag}; name one")
    return tag if tag is not None else flag


def config_from_args(args: argparse.Namespace) -> StallfreeConfig:
    overrides: dict[str, dict[str, Any]] = {
        "model": {},
        "runtime": {},
        "parallel": {},
        "cache": {},
        "scheduler": {},
        "server": {},
        "metrics": {},
        "speculative": {},
        "disaggregation": {},
    }
    pairs = {
        "dtype": ("model", "dtype"),
        "quantization": ("model", "quantization"),
        "model_impl": ("model", "model_impl"),
        "enable_torch_compile": ("runtime", "torch_compile"),
        "max_model_len": ("model", "max_context_len"),
        "model_seed": ("model", "seed"),
        "device": ("runtime", "device"),
        "overlap": ("runtime", "overlap"),
        "cpu_mirrors": ("runtime", "cpu_mirrors"),
        "log_requests": ("runtime", "log_requests"),
        "worker": ("runtime", "worker"),
        "step_timeout_s": ("runtime", "step_timeout_s"),
        "tp_size": ("parallel", "tp_size"),
        "nnodes": ("parallel", "nnodes"),
        "node_rank": ("parallel", "node_rank"),
        "dist_init_addr": ("parallel", "dist_init_addr"),
        "dist_timeout_s": ("parallel", "dist_timeout_s"),
        "page_size": ("cache", "page_size"),
        "max_total_tokens": ("cache", "max_total_tokens"),
        "max_running_requests": ("cache", "max_running_requests"),
        "chunked_prefill_size": ("scheduler", "chunked_prefill_size"),
        "max_prefill_tokens": ("scheduler", "max_prefill_tokens"),
        "max_unread_tokens": ("scheduler", "max_unread_tokens"),
        "prefix_caching": ("cache", "prefix_caching"),
        "schedule_policy": ("scheduler", "policy"),
        "host": ("server", "host"),
        "port": ("server", "port"),
        "api_key": ("server", "api_key"),
        "served_model_name": ("server", "served_model_name"),
        "chat_template": ("server", "chat_template"),
        "generation_config": ("server", "generation_config"),
        "enable_auto_tool_choice": ("server", "enable_auto_tool_choice"),
        "tool_call_parser": ("server", "tool_call_parser"),
        "reasoning_parser": ("server", "reasoning_parser"),
        "max_request_cost": ("server", "max_request_cost"),
        "max_chat_messages": ("server", "max_chat_messages"),
        "max_content_parts": ("server", "max_content_parts"),
        "write_timeout_s": ("server", "write_timeout_s"),
        "root_path": ("server", "root_path"),
        "uds": ("server", "uds"),
        "ssl_keyfile": ("server", "ssl_keyfile"),
        "ssl_certfile": ("server", "ssl_certfile"),
        "ssl_ca_certs": ("server", "ssl_ca_certs"),
        "ssl_cert_reqs": ("server", "ssl_cert_reqs"),
        "allowed_origins": ("server", "allowed_origins"),
        "allowed_methods": ("server", "allowed_methods"),
        "allowed_headers": ("server", "allowed_headers"),
        "allow_credentials": ("server", "allow_credentials"),
        "otlp_traces_endpoint": ("server", "otlp_traces_endpoint"),
        "log_level": ("server", "log_level"),
        "uvicorn_log_level": ("server", "uvicorn_log_level"),
        "access_log": ("server", "access_log"),
        "metrics": ("metrics", "enabled"),
        "speculative_adaptive": ("speculative", "adaptive"),
        "speculative_min_acceptance_rate": ("speculative", "min_acceptance_rate"),
    }
    model = _model(args)
    if model is not None:
        overrides["model"]["path"] = model
    for flag, (section, key) in pairs.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[section][key] = value
    keys = overrides["server"].get("api_key")
    if isinstance(keys, list) and len(keys) == 1:
        overrides["server"]["api_key"] = keys[0]  # `--api-key K` once: one key, as before
    overrides["speculative"].update(speculative_settings(args))
    overrides["disaggregation"].update(disaggregation_settings(args))
    config = load_config(args.config, **{k: v for k, v in overrides.items() if v})
    check_speculative_flags(args, config)
    return config


async def _generate(args: argparse.Namespace, config: StallfreeConfig) -> int:
    from stallfree.runtime.engine import Engine
    from stallfree.runtime.request.sampling_params import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    async with Engine(config) as engine:
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


def _serve(config: StallfreeConfig) -> int:
    if config.parallel.node_rank > 0:
        return serve_worker_node(config)
    if needs_extra("stallfree serve", "server", SERVER_MODULES):
        return 2
    from stallfree.entrypoints.server import serve

    # 0 after a drained shutdown (SIGTERM or SIGINT); 1 if the engine died
    return serve(config)


def _router(args: argparse.Namespace) -> int:
    try:
        settings = router_settings(args)
    except ValueError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    if needs_extra("stallfree router", "server", ROUTER_MODULES):
        return 2
    from stallfree.entrypoints.router import serve_router

    try:
        return run_async(serve_router(settings))
    except KeyboardInterrupt:  # before it listens: waiting for the servers
        return 130


def serve_worker_node(config: StallfreeConfig) -> int:
    """`serve` on a node other than 0: no HTTP server, no scheduler; run this node's worker
    ranks, sized as node 0 sizes its pools, until node 0 stops them (or they fail)."""
    from stallfree.runtime.execution.worker import WorkerStartError, run_worker_node
    from stallfree.runtime.model.loader import check_tensor_parallel, read_arch
    from stallfree.runtime.scheduling.sizing import auto_stream_threads, pool_sizes

    check_tensor_parallel(config.model.path, config.parallel.tp_size)
    arch = read_arch(config.model.path)
    max_context_len, num_kv_slots = pool_sizes(config, arch)
    per_node = config.parallel.tp_size // config.parallel.nnodes
    threads = config.runtime.stream_threads or auto_stream_threads(arch, per_node)
    config = config.model_copy(
        update={"runtime": config.runtime.model_copy(update={"stream_threads": threads})}
    )
    par = config.parallel
    per_node = par.tp_size // par.nnodes
    first = par.node_rank * per_node
    ranks = f"rank {first}" if per_node == 1 else f"ranks {first}-{first + per_node - 1}"
    print(
        f"stallfree: node {par.node_rank} of {par.nnodes} runs tensor-parallel {ranks} of "
        f"{par.tp_size} (meeting at {par.dist_init_addr}); no HTTP server here, node 0 serves",
        flush=True,
    )

    def stop(signum: int, frame: Any) -> None:
        # exiting through Python (not the default SIGTERM death) lets multiprocessing
        # terminate and join the worker processes, so none is left behind
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return run_worker_node(config, max_context_len, num_kv_slots)
    except WorkerStartError as exc:
        print(f"stallfree: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_async(coro: Any) -> int:
    """Run `coro` to completion on uvloop (asyncio without it); its result is an exit code."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return int(asyncio.run(coro))
    # only the import is guarded: an ImportError raised by the command itself propagates
    return int(uvloop.run(coro))


def subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the parser has no subcommands")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that an unknown flag is reported with the usage of the
    subcommand it was given to (exit status 2), not the top-level usage."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = subparsers(parser).choices.get(getattr(args, "command", None) or "", parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stallfree", description=__doc__, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one completion", formatter_class=HelpFormatter)
    add_engine_flags(gen)
    add_speculative_flags(gen)
    add_sampling_flags(gen)
    srv = sub.add_parser(
        "serve",
        help="run the HTTP server (OpenAI-compatible API, /metrics)",
        description="Serve a model over HTTP: the OpenAI-compatible API, /generate, /health "
        "and /metrics. vLLM's flag spellings work beside stallfree's own.",
        formatter_class=HelpFormatter,
    )
    add_server_flags(srv)
    add_engine_flags(srv)
    add_speculative_flags(srv)
    add_disaggregation_flags(srv)
    rtr = sub.add_parser(
        "router",
        help="route requests to prefill and decode servers (disaggregated serving)",
        description="An OpenAI-compatible front for prefill/decode disaggregation: each "
        "request goes to a prefill and a decode server at once, and the decode server's "
        "answer is streamed back. SGLang's router flag spellings work.",
        formatter_class=RouterHelpFormatter,
    )
    add_router_flags(rtr)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed `generate` or `serve`; every expected failure is one line on stderr and
    exit status 2."""
    if args.command == "router":
        return _router(args)
    try:
        config = config_from_args(args)
        if args.command == "generate":
            if config.parallel.node_rank > 0:
                raise ValueError(
                    "generate runs on node 0 (--node-rank 0); start the other nodes with "
                    "`stallfree serve ... --node-rank N`"
                )
            return run_async(_generate(args, config))
        if args.command == "serve":
            return _serve(config)
    except ValidationError as exc:
        print(f"stallfree: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"stallfree: {exc}", file=sys.stderr)
        return 2
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
