"""The `stallfree` command line."""

# the docstring above is the parser's description; `stallfree.cli` adds `bench` to it

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from stallfree.config import StallfreeConfig, load_config
from stallfree.config.model_source import resolve_model_source
from stallfree.entrypoints.disagg_flags import DISAGGREGATION_FLAGS, disaggregation_settings
from stallfree.entrypoints.flags import (
    ENGINE_FLAGS,
    SAMPLING_FLAGS,
    HelpFormatter,
    add_flags,
    settings_from_args,
)

# the tests import the token-count type from here, where it was defined
from stallfree.entrypoints.flags import token_count as token_count
from stallfree.entrypoints.lora_flags import LORA_FLAGS
from stallfree.entrypoints.replica_flags import REPLICA_FLAGS
from stallfree.entrypoints.router.flags import (
    RouterHelpFormatter,
    add_router_flags,
    router_settings,
)
from stallfree.entrypoints.server_flags import SERVER_FLAGS
from stallfree.entrypoints.spec_flags import (
    SPECULATIVE_FLAGS,
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
    overrides = settings_from_args(
        args, ENGINE_FLAGS, SERVER_FLAGS, SPECULATIVE_FLAGS, REPLICA_FLAGS, LORA_FLAGS
    )
    model = _model(args)
    if model is not None:
        overrides.setdefault("model", {})["path"] = model
    keys = overrides.get("server", {}).get("api_key")
    if isinstance(keys, list) and len(keys) == 1:
        overrides["server"]["api_key"] = keys[0]  # `--api-key K` once: one key, as before
    for section, settings in (
        ("speculative", speculative_settings(args)),
        ("disaggregation", disaggregation_settings(args)),
    ):
        overrides.setdefault(section, {}).update(settings)
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
    if config.replicas.data_parallel_size == 1:
        # the cyclic collector stays off through the imports and the load: they make about
        # 230 thousand objects that all live on, and its three full passes over them were
        # 0.2-0.3 s of SmolLM2's start-up. The app collects once and turns it back on as the
        # engine starts (server/app.py, `freeze_heap`).
        gc.disable()
    if needs_extra("stallfree serve", "server", SERVER_MODULES):
        return 2
    if config.replicas.data_parallel_size > 1:
        if needs_extra("stallfree serve --data-parallel-size", "server", ROUTER_MODULES):
            return 2
        from stallfree.entrypoints.replicas import serve_replicas

        return run_async(serve_replicas(config))
    from stallfree.entrypoints.server import serve

    # 0 after a drained shutdown (SIGTERM or SIGINT); 1 if the engine died
    status: int = serve(config)
    return status


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
    from stallfree.runtime.execution.worker_launch import WorkerStartError, run_worker_node
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


def subparsers(
    parser: argparse.ArgumentParser,
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
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
    for table in (ENGINE_FLAGS, SPECULATIVE_FLAGS, SAMPLING_FLAGS):
        add_flags(gen, table)
    srv = sub.add_parser(
        "serve",
        help="run the HTTP server (OpenAI-compatible API, /metrics)",
        description="Serve a model over HTTP: the OpenAI-compatible API, /generate, /health "
        "and /metrics. vLLM's flag spellings work beside stallfree's own.",
        formatter_class=HelpFormatter,
    )
    for table in (
        SERVER_FLAGS, ENGINE_FLAGS, REPLICA_FLAGS, SPECULATIVE_FLAGS, DISAGGREGATION_FLAGS,
        LORA_FLAGS,
    ):  # fmt: skip
        add_flags(srv, table)
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
        config = resolve_model_source(config_from_args(args))
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
