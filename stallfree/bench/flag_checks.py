"""`stallfree bench`'s checks across its flags: `vllm bench serve`'s ways of naming the target
turned into this command's own, then every combination the command refuses, each a
`UsageError` that says what to drop or add. The flags themselves are in `bench.flags`."""

from __future__ import annotations

import argparse
import math

from stallfree.bench.flags import ENDPOINTS
from stallfree.bench.report import check_plot_available
from stallfree.entrypoints.spec_flags import SPEC_DEST


class UsageError(ValueError):
    """A bad combination of flags."""


def check_arrival_flags(args: argparse.Namespace) -> None:
    """--burstiness and the ramp-up flags, checked as `vllm bench serve` checks them."""
    if not args.burstiness > 0:
        raise UsageError(f"--burstiness must be positive (got {args.burstiness})")
    if args.ramp_up_strategy is None:
        if args.ramp_up_start_rps is not None or args.ramp_up_end_rps is not None:
            raise UsageError("--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy")
        return
    if not math.isinf(args.request_rate):
        raise UsageError(
            "When using ramp-up, do not specify --request-rate. The request rate will be "
            "controlled by ramp-up parameters. Please remove the --request-rate argument."
        )
    start, end = args.ramp_up_start_rps, args.ramp_up_end_rps
    if start is None or end is None:
        raise UsageError(
            "When using --ramp-up-strategy, both --ramp-up-start-rps and --ramp-up-end-rps "
            "must be specified"
        )
    if start <= 0 or end <= 0 or math.isinf(start) or math.isinf(end):
        raise UsageError("Ramp-up start and end RPS must be positive and finite")
    if start > end:
        raise UsageError("Ramp-up start RPS must be less than end RPS")


def _resolve_vllm_flags(args: argparse.Namespace) -> None:
    """Turn `vllm bench serve`'s ways of naming the target into this command's own."""
    if args.host is not None or args.port is not None:
        if args.base_url:
            raise UsageError("give the server as --base-url or as --host/--port, not both")
        args.base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    if args.endpoint is not None:
        implied = ENDPOINTS[args.endpoint]
        if args.backend not in (None, implied) and not (
            args.backend == "vllm" and implied == "openai"
        ):
            raise UsageError(
                f"--endpoint {args.endpoint} does not go with --backend {args.backend}"
            )
        args.backend = args.backend or implied
    if args.backend is not None:
        if args.target == "inprocess":
            raise UsageError(
                "--backend picks an HTTP API; it needs --base-url or --target http, not "
                "--target inprocess"
            )
        if not args.base_url:
            args.target = "http"
    if args.result_dir or args.result_filename:
        args.save_result = True


def _comparing(args: argparse.Namespace) -> bool:
    return bool(args.compare or args.compare_workers or args.compare_tp)


def _check_worker_flags(args: argparse.Namespace) -> None:
    if args.compare_workers and args.compare_tp:
        raise UsageError(
            "--compare-workers and --compare-tp cannot go together: a tp size above 1 needs "
            "worker processes; compare the workers at one size, or the sizes in worker processes"
        )
    if args.compare_workers and args.worker is not None:
        raise UsageError("--compare-workers sets --worker per mode; drop --worker")
    if args.compare_tp and args.tp_size is not None:
        raise UsageError("--compare-tp sets --tp-size per mode; drop --tp-size")
    if (args.compare_workers or args.compare_tp) and args.hisparse in ("on", "both"):
        raise UsageError("HiSparse does not run with worker processes yet; drop --hisparse on/both")
    if not args.base_url and ((args.nnodes or 1) > 1 or (args.node_rank or 0) > 0):
        raise UsageError(
            "bench starts a fresh engine for every run, which a group spanning several nodes "
            "cannot follow; start it with `stallfree serve --nnodes ...` on each node and "
            "measure it with --base-url"
        )


def check_flags(args: argparse.Namespace) -> None:
    """Every check across `stallfree bench`'s flags, after vLLM's spellings of the target are
    turned into ours; fills in --repeats' default (3 when comparing, else 1)."""
    _resolve_vllm_flags(args)
    if args.repeats is None:
        args.repeats = 3 if _comparing(args) else 1
    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1 (got {args.repeats})")
    _check_worker_flags(args)
    if (args.compare_workers or args.compare_tp) and args.base_url:
        raise UsageError(
            "--compare-workers and --compare-tp start an engine per mode, so they cannot "
            "measure the server at --base-url; drop --base-url (add --target http to compare "
            "over HTTP)"
        )
    if args.compare and args.base_url:
        raise UsageError(
            "--compare starts its own server (or engine) per mode, so it cannot measure the "
            "server at --base-url; drop --compare to benchmark that server, or drop --base-url "
            "to compare modes (add --target http to compare over HTTP)"
        )
    if args.target == "inprocess" and args.base_url:
        raise UsageError("--base-url needs --target http (or no --target)")
    if args.compare and (args.overlap is not None or args.cpu_mirrors is not None):
        raise UsageError(
            "--compare sets --overlap and --cpu-mirrors per mode; drop them (use --modes)"
        )
    if args.modes and not args.compare:
        raise UsageError("--modes only applies with --compare")
    if args.hisparse == "both" and not args.compare:
        raise UsageError("--hisparse both needs --compare")
    if args.compare_prefix_caching and not args.compare:
        raise UsageError("--compare-prefix-caching needs --compare")
    if args.compare_prefix_caching and args.prefix_caching is not None:
        raise UsageError(
            "--compare-prefix-caching sets the prefix cache per mode; drop "
            "--enable-prefix-caching / --no-enable-prefix-caching / --disable-radix-cache"
        )
    if args.compare_prefix_caching and args.hisparse in ("on", "both"):
        raise UsageError("the prefix cache cannot run with HiSparse; drop --hisparse on/both")
    if args.base_url and args.hisparse:
        raise UsageError("--hisparse configures an engine this command starts, not --base-url")
    spec_flags = bool(getattr(args, SPEC_DEST, None)) or (
        getattr(args, "speculative_adaptive", None) is not None
    )
    if args.base_url and spec_flags:
        raise UsageError(
            "the speculative decoding flags configure an engine this command starts, not "
            "--base-url (start that server with them)"
        )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UsageError("--max-concurrency must be at least 1")
    if args.warmup_requests < 0:
        raise UsageError("--warmup-requests must be >= 0")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        raise UsageError("--random-range-ratio must be within [0, 1]")
    check_arrival_flags(args)
    if args.plot:
        check_plot_available()
