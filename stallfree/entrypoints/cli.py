"""The `stallfree` command line."""

# NOTE: the docstring above is the parser's description; `stallfree.cli` adds `bench` to it

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from stallfree.config import (
    CacheConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    StallfreeConfig,
    load_config,
)

_SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "runtime": RuntimeConfig,
    "parallel": ParallelConfig,
    "server": ServerConfig,
    "metrics": MetricsConfig,
}
# what each command needs beyond the base install, and the extra that brings it
SERVER_MODULES = ("fastapi", "uvicorn", "jinja2")
LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
# vLLM's --dtype spellings that name the same type as one of ours
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ["auto", "float32", "float16", "bfloat16"]


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows every flag's default: taken from argparse unless the help text already
    names one (the engine flags name the config's own default, since theirs is None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or not action.option_strings or default is argparse.SUPPRESS:
            return text
        if default is False and action.nargs == 0:
            return text + " (default: off)"  # a switch
        if default is None or default is False:
            return text
        return text + " (default: %(default)s)"


def config_default(section: str, key: str) -> Any:
    """The built-in default of the setting `section.key`."""
    return _SECTIONS[section].model_fields[key].default


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _help(text: str, section: str, key: str, when_unset: str | None = None) -> str:
    """`text`, then the setting's default (`when_unset` where the config leaves it None) and
    the setting it fills."""
    value = config_default(section, key)
    shown = when_unset if value is None else _shown(value)
    return f"{text} (default: {shown}; sets {section}.{key})".replace("%", "%%")


def token_count(text: str) -> int:
    """A positive token count, with vLLM's shorthand: 32k = 32000, 32K = 32768, 1m = 10**6,
    1M = 2**20 (a decimal before a lowercase suffix, such as 1.5k, is allowed)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 32k, 32K)")
    number, suffix = m.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    value = float(number) * scale[suffix]
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"not a whole, positive token count: {text!r}")
    return int(value)


def _dtype(text: str) -> str:
    value = _DTYPE_ALIASES.get(text, text)
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join([*DTYPES, *_DTYPE_ALIASES])})"
        )
    return value


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


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Worker processes, tensor parallelism and the multi-node launch (vLLM's and SGLang's
    spellings beside stallfree's)."""
    g = p.add_argument_group("parallel")
    g.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        "-tp",
        dest="tp_size",
        type=int,
        metavar="N",
        help=_help(
            "tensor-parallel ranks the model is sharded over, each in its own worker process "
            "(SGLang's and vLLM's spellings)",
            "parallel",
            "tp_size",
        ),
    )
    g.add_argument(
        "--worker",
        choices=["auto", "inprocess", "process"],
        help=_help(
            "where the model runs: inprocess (the scheduler's process) or process (worker "
            "processes); auto: process when --tp-size > 1",
            "runtime",
            "worker",
        ),
    )
    g.add_argument(
        "--nnodes",
        type=int,
        metavar="N",
        help=_help(
            "machines the tensor-parallel group spans; --tp-size counts the ranks of all",
            "parallel",
            "nnodes",
        ),
    )
    g.add_argument(
        "--node-rank",
        type=int,
        metavar="I",
        help=_help(
            "this machine's index; node 0 serves HTTP and runs the scheduler, every other node "
            "only runs its worker ranks and exits when node 0 stops them",
            "parallel",
            "node_rank",
        ),
    )
    g.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        help=_help(
            "where the ranks of every node meet (tcp://HOST:PORT works too); needed with "
            "--nnodes > 1",
            "parallel",
            "dist_init_addr",
            "a free local port",
        ),
    )
    g.add_argument(
        "--dist-timeout",
        dest="dist_timeout_s",
        type=_positive_seconds,
        metavar="SECONDS",
        help=_help(
            "how long the ranks' meeting or one collective may take before it fails",
            "parallel",
            "dist_timeout_s",
        ),
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose and size the engine (shared by `generate`, `serve` and `bench`).
    Where vLLM and SGLang spell one differently, both spellings work."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        help="a Hugging Face model directory, a .gguf file (weights, tokenizer and chat template "
        "all read from it), or a preset with random weights: tiny, bench-cpu (default: tiny; "
        "sets model.path)",
    )
    g.add_argument(
        "--config",
        help="a TOML config file; flags win over STALLFREE_* variables, which win over it "
        "(default: none)",
    )
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help=_help("auto: CUDA when available, else the CPU-emulated stream", "runtime", "device"),
    )
    g.add_argument(
        "--dtype",
        type=_dtype,
        metavar="{" + ",".join([*DTYPES, *_DTYPE_ALIASES]) + "}",
        help=_help(
            "weights and KV dtype; auto: the checkpoint's, float32 on CPU (half = float16, "
            "float = float32)",
            "model",
            "dtype",
        ),
    )
    g.add_argument(
        "--max-model-len",
        type=token_count,
        metavar="TOKENS",
        help=_help(
            "cap on prompt + output tokens per request; 32k = 32000, 32K = 32768",
            "model",
            "max_context_len",
            "the model's own",
        ),
    )
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help("launch batch N+1 before processing batch N", "runtime", "overlap"),
    )
    g.add_argument(
        "--cpu-mirrors",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help(
            "schedule from host mirrors; off is the legacy mode that syncs",
            "runtime",
            "cpu_mirrors",
        ),
    )
    g.add_argument("--page-size", type=int, help=_help("tokens per KV page", "cache", "page_size"))
    g.add_argument(
        "--max-total-tokens",
        type=int,
        help=_help("KV slots in the device pool", "cache", "max_total_tokens"),
    )
    g.add_argument(
        "--max-num-seqs",
        "--max-running-requests",
        dest="max_running_requests",
        type=int,
        metavar="N",
        help=_help(
            "most requests running at once (vLLM's and SGLang's spellings)",
            "cache",
            "max_running_requests",
        ),
    )
    g.add_argument(
        "--max-num-batched-tokens",
        "--max-prefill-tokens",
        dest="max_prefill_tokens",
        type=int,
        metavar="TOKENS",
        help=_help(
            "prompt tokens one step may prefill, over all requests; it bounds each chunk too "
            "(vLLM's and SGLang's spellings)",
            "scheduler",
            "max_prefill_tokens",
        ),
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        help=_help(
            "longest prompt chunk one request prefills in a step",
            "scheduler",
            "chunked_prefill_size",
        ),
    )
    g.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help(
            "share the KV of common prefixes", "cache", "prefix_caching", "on, off with HiSparse"
        ),
    )
    g.add_argument(
        "--disable-radix-cache",
        dest="prefix_caching",
        action="store_const",
        const=False,
        help="turn the prefix cache off, as --no-enable-prefix-caching does (SGLang's "
        "spelling; default: on, off with HiSparse)",
    )
    g.add_argument(
        "--schedule-policy",
        choices=["fcfs", "lpm"],
        help=_help(
            "admission order: fcfs (arrival) or lpm (longest cached prefix first)",
            "scheduler",
            "policy",
        ),
    )
    add_parallel_flags(p)


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
    }
    pairs = {
        "dtype": ("model", "dtype"),
        "max_model_len": ("model", "max_context_len"),
        "model_seed": ("model", "seed"),
        "device": ("runtime", "device"),
        "overlap": ("runtime", "overlap"),
        "cpu_mirrors": ("runtime", "cpu_mirrors"),
        "log_requests": ("runtime", "log_requests"),
        "worker": ("runtime", "worker"),
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
        "prefix_caching": ("cache", "prefix_caching"),
        "schedule_policy": ("scheduler", "policy"),
        "host": ("server", "host"),
        "port": ("server", "port"),
        "api_key": ("server", "api_key"),
        "served_model_name": ("server", "served_model_name"),
        "chat_template": ("server", "chat_template"),
        "log_level": ("server", "log_level"),
        "uvicorn_log_level": ("server", "uvicorn_log_level"),
        "access_log": ("server", "access_log"),
        "metrics": ("metrics", "enabled"),
    }
    model = _model(args)
    if model is not None:
        overrides["model"]["path"] = model
    for flag, (section, key) in pairs.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[section][key] = value
    return load_config(args.config, **{k: v for k, v in overrides.items() if v})


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


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as with --model (vLLM's `serve MODEL`)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", help=_help("bind address", "server", "host"))
    g.add_argument("--port", type=int, help=_help("TCP port; 0 picks a free one", "server", "port"))
    g.add_argument(
        "--api-key",
        metavar="KEY",
        help=_help(
            "require 'Authorization: Bearer KEY' on the API routes (an empty key is refused)",
            "server",
            "api_key",
            "none: the API is open",
        ),
    )
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        help=_help(
            "model id in the API and the metrics", "server", "served_model_name", "the model path"
        ),
    )
    g.add_argument(
        "--chat-template",
        metavar="TEMPLATE",
        help=_help(
            "chat template of /v1/chat/completions instead of the model's own: a Jinja file, or "
            "the template text itself",
            "server",
            "chat_template",
            "the model's",
        ),
    )
    g.add_argument(
        "--seed",
        dest="model_seed",
        type=int,
        metavar="SEED",
        help=_help("seed of preset weights and of unseeded sampling", "model", "seed"),
    )
    g.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help("Prometheus metrics at /metrics", "metrics", "enabled"),
    )
    g.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help=_help("level of the server's and the engine's logs", "server", "log_level"),
    )
    g.add_argument(
        "--uvicorn-log-level",
        choices=LOG_LEVELS,
        help=_help(
            "level of uvicorn's own logs only", "server", "uvicorn_log_level", "--log-level's"
        ),
    )
    g.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help(
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
        help=_help("log each request's arrival and finish at INFO", "runtime", "log_requests"),
    )
    g.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_const",
        const=False,
        help="do not log each request (the default; vLLM's spelling)",
    )


def _serve(config: StallfreeConfig) -> int:
    if config.parallel.node_rank > 0:
        return serve_worker_node(config)
    if needs_extra("stallfree serve", "server", SERVER_MODULES):
        return 2
    from stallfree.entrypoints.server import serve

    # NOTE: 0 after a drained shutdown (SIGTERM or SIGINT); 1 if the engine died
    return serve(config)


def serve_worker_node(config: StallfreeConfig) -> int:
    """`serve` on a node other than 0: no HTTP server, no scheduler; run this node's worker
    ranks, sized as node 0 sizes its pools, until node 0 stops them (or they fail)."""
    from stallfree.runtime.core import auto_stream_threads, pool_sizes
    from stallfree.runtime.execution.worker import WorkerStartError, run_worker_node
    from stallfree.runtime.model.loader import check_tensor_parallel, read_arch

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
        # NOTE: exiting through Python (not the default SIGTERM death) lets multiprocessing
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
    # NOTE: only the import is guarded: an ImportError raised by the command itself propagates
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
    gen.add_argument("prompt")
    s = gen.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--seed", type=int, help="seed of this request's sampling (default: none)")
    s.add_argument("--ignore-eos", action="store_true", help="generate past the EOS token")
    srv = sub.add_parser(
        "serve",
        help="run the HTTP server (OpenAI-compatible API, /metrics)",
        description="Serve a model over HTTP: the OpenAI-compatible API, /generate, /health "
        "and /metrics. vLLM's flag spellings work beside stallfree's own.",
        formatter_class=HelpFormatter,
    )
    _add_server_flags(srv)
    add_engine_flags(srv)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed `generate` or `serve`; every expected failure is one line on stderr and
    exit status 2."""
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
