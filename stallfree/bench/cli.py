"""`stallfree bench`: the choice of modes and target, the progress bar, the result files, and
exit codes (its flags are in `bench.flags`, the checks across them in `bench.flag_checks`)."""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from stallfree.bench.datasets import build_requests
from stallfree.bench.flag_checks import UsageError, check_flags
from stallfree.bench.flags import DESCRIPTION, add_bench_arguments
from stallfree.bench.report import PlotUnavailableError, print_table, write_json, write_plot
from stallfree.bench.results import RunResult
from stallfree.bench.runner import (
    CONFIGURED,
    MODE_KEYS,
    Mode,
    RunSettings,
    TargetFactory,
    compare_modes,
    inprocess_targets,
    launched_http_targets,
    merge_settings,
    run_modes,
    url_targets,
    worker_modes,
)
from stallfree.bench.slo import detailed_lists, print_figures, run_figures
from stallfree.bench.targets import TargetError
from stallfree.bench.workloads import WorkloadError, WorkloadSpec

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


# what the bench imports beyond the base install (its extra also brings the server's and
# matplotlib, which --plot checks for itself)
BENCH_MODULES = ("rich", "httpx", "numpy")


def _mode_keys(args: argparse.Namespace) -> list[str] | None:
    if not args.modes:
        return None
    keys = [k.strip() for k in args.modes.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODE_KEYS]
    if unknown or not keys:
        raise UsageError(f"unknown mode(s) {unknown}; choose from {', '.join(MODE_KEYS)}")
    return keys


def _modes(args: argparse.Namespace) -> list[Mode]:
    if args.base_url:
        return [Mode("target")]
    if args.compare:
        modes = compare_modes(args.hisparse, _mode_keys(args), args.compare_prefix_caching)
    elif args.hisparse is None:
        modes = [Mode(CONFIGURED)]
    else:
        modes = [Mode(CONFIGURED, {"hisparse": {"enabled": args.hisparse == "on"}})]
    return worker_modes(modes, args.compare_workers, args.compare_tp, args.worker is None)


def _context_len(args: argparse.Namespace) -> int | None:
    """The engine's context limit, when this process knows it (not for --base-url)."""
    if args.base_url:
        return None
    from stallfree.entrypoints.cli import config_from_args
    from stallfree.runtime.model.loader import PRESETS

    model = config_from_args(args).model
    preset = PRESETS.get(model.path)
    limits = [n for n in (model.max_context_len, preset and preset.max_position_embeddings) if n]
    return min(limits) if limits else None


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        max_context_len=_context_len(args),
        kind=args.workload,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.random_range_ratio,
        dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
        prefix_groups=args.prefix_groups,
        prefix_len=args.prefix_len,
        seed=args.seed,
        custom_output_len=args.custom_output_len,
        sonnet_input_len=args.sonnet_input_len,
        sonnet_output_len=args.sonnet_output_len,
        sonnet_prefix_len=args.sonnet_prefix_len,
    )


def _tokenize(args: argparse.Namespace) -> Any:
    if args.workload not in ("sharegpt", "custom", "sonnet"):
        return None
    from stallfree.runtime.model.loader import load_tokenizer

    source = args.tokenizer or args.model or "tiny"
    try:
        return load_tokenizer(source).encode
    except (ValueError, OSError) as exc:
        raise WorkloadError(
            f"cannot load tokenizer {source!r} for {args.workload} prompt lengths: {exc}"
        ) from None


def _targets(args: argparse.Namespace) -> tuple[TargetFactory, dict[str, Any]]:
    from stallfree.entrypoints.cli import config_from_args

    if args.base_url:
        info = {"kind": "http", "base_url": args.base_url, "backend": args.backend or "openai"}
        model = args.served_model_name or args.model
        return url_targets(args.base_url, model, args.api_key, args.backend), info
    base = config_from_args(args)
    if args.stream_threads is not None:
        base = merge_settings(base, Mode("", {"runtime": {"stream_threads": args.stream_threads}}))
    info = {"base_engine_config": base.model_dump(mode="json")}
    if args.target == "http":
        info["kind"] = "http (stallfree serve per mode)"
        info["backend"] = args.backend or "openai"
        return launched_http_targets(base, args.config, args.startup_timeout, args.backend), info
    info["kind"] = "inprocess"
    return inprocess_targets(base), info


class _RichProgress:
    """A bar per mode on stderr: requests completed out of the workload."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self.task: Any = None

    def begin(self, name: str, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description:<36}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.progress.start()
        self.task = self.progress.add_task(name, total=total)

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)

    def end(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _model_id(results: list[RunResult]) -> str | None:
    target = results[0].settings["target"]
    model = target.get("model") or target.get("engine_config", {}).get("model", {}).get("path")
    return None if model is None else str(model)


def _backend(args: argparse.Namespace) -> str:
    """The API the bench drove: openai, openai-chat or sglang over HTTP, stallfree in process."""
    if args.base_url or args.target == "http":
        return str(args.backend or "openai")
    return "stallfree"


def _vllm_header(args: argparse.Namespace, results: list[RunResult]) -> dict[str, Any]:
    """The settings `vllm bench serve` puts first in its result file, under its names."""
    model = _model_id(results)
    header = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": _backend(args),
        "endpoint_type": _backend(args),
        "label": args.label or _backend(args),
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    if args.ramp_up_strategy is not None:
        header["ramp_up_strategy"] = args.ramp_up_strategy
        header["ramp_up_start_rps"] = args.ramp_up_start_rps
        header["ramp_up_end_rps"] = args.ramp_up_end_rps
    return {**header, **dict(args.metadata or [])}


def result_path(args: argparse.Namespace, header: dict[str, Any]) -> Path:
    """Where `--save-result` writes: `--result-dir` / `--result-filename`, or vLLM's name
    `LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json` (LABEL: --label, else the backend; with a
    ramp-up, `LABEL-ramp-up-STRATEGY-STARTqps-ENDqps...`)."""
    name: str | None = args.result_filename
    if not name:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(header["model_id"] or "model").rstrip("/").split("/")[-1]
        rate = f"{args.request_rate}qps"
        if args.ramp_up_strategy is not None:
            rate = (
                f"ramp-up-{args.ramp_up_strategy}-{args.ramp_up_start_rps}qps-"
                f"{args.ramp_up_end_rps}qps"
            )
        label = args.label or header["backend"]
        name = f"{label}-{rate}{concurrency}-{model}-{header['date']}.json"
    directory = Path(args.result_dir or ".")
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def _title(args: argparse.Namespace, info: dict[str, Any], results: list[RunResult]) -> str:
    model = _model_id(results)
    where = args.base_url or info["kind"]
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    if args.ramp_up_strategy is not None:
        rate = (
            f"{args.ramp_up_strategy} ramp-up {args.ramp_up_start_rps:g}-{args.ramp_up_end_rps:g}/s"
        )
    if args.burstiness != 1.0:
        rate += f" (burstiness {args.burstiness:g})"
    repeats = f"; median of {args.repeats} runs, modes interleaved" if args.repeats > 1 else ""
    return (
        f"stallfree bench: {where}, model {model or '?'}, {args.workload} x {args.num_prompts}, "
        f"rate {rate}, concurrency {args.max_concurrency or 'unlimited'}, seed {args.seed}"
        f"{repeats}"
    )


async def _bench(args: argparse.Namespace) -> int:
    modes = _modes(args)
    spec = _workload(args)
    requests = build_requests(spec, _tokenize(args))
    open_target, info = _targets(args)
    rs = RunSettings(
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        warmup_requests=args.warmup_requests,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        burstiness=args.burstiness,
        ramp_up=None
        if args.ramp_up_strategy is None
        else (args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps),
    )
    from rich.console import Console  # the bench extra; run_bench checked it is there

    err = Console(stderr=True)
    progress = None if args.no_progress else _RichProgress(err)
    results = await run_modes(modes, open_target, requests, rs, progress, args.repeats)
    title = _title(args, info, results)
    print_table(results, title)
    figures = [_figures(args, r) for r in results]
    print_figures(Console(width=None if Console().is_terminal else 200), results, figures)
    config = {
        "command": "stallfree bench",
        "arguments": {
            k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items()
            if k != "func"
        },
        "target": info,
        "workload": asdict(spec),
        "run": {
            **asdict(rs),
            "request_rate": str(rs.request_rate)
            if math.isinf(rs.request_rate)
            else rs.request_rate,
        },
        "modes": [asdict(m) for m in modes],
        "repeats": args.repeats,
    }
    header = _vllm_header(args, results)
    detailed = detailed_lists(results[0]) if args.save_detailed and len(results) == 1 else None
    outputs = [args.output_json] if args.output_json else []
    if args.save_result:
        outputs.append(str(result_path(args, header)))
    for path in outputs:
        write_json(path, results, config, header, lambda r: _figures(args, r), detailed)
        err.print(f"wrote {path}")
    if args.plot:
        write_plot(args.plot, results, title)
        err.print(f"wrote {args.plot}")
    return 1 if all(x.summary.completed == 0 for r in results for x in r.runs) else 0


def _figures(args: argparse.Namespace, result: RunResult) -> dict[str, Any]:
    slos = None if args.goodput is None else dict(args.goodput)
    return run_figures(result, slos, args.percentile_metrics, args.metric_percentiles)


def run_bench(args: argparse.Namespace) -> int:
    """Run `stallfree bench`; every expected failure is one line on stderr and a non-zero code."""
    from stallfree.entrypoints.cli import SERVER_MODULES, needs_extra, run_async

    if needs_extra("stallfree bench", "bench", BENCH_MODULES):
        return 2
    try:
        check_flags(args)
        launches = args.target == "http" and not args.base_url
        if launches and needs_extra("stallfree bench --target http", "bench", SERVER_MODULES):
            return 2
        return run_async(_bench(args))
    except (UsageError, PlotUnavailableError) as exc:
        print(f"stallfree bench: error: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"stallfree bench: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except (TargetError, WorkloadError, OSError, ValueError) as exc:
        print(f"stallfree bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stallfree bench: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (`python -m stallfree.bench.cli`); `stallfree bench` uses the same flags."""
    parser = argparse.ArgumentParser(prog="stallfree bench", description=DESCRIPTION)
    add_bench_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
