"""Reports: the terminal table (a column per mode, ratios to the first), the JSON file, the PNG."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree.bench.results import (
    Distribution,
    RequestRecord,
    RunResult,
    RunSummary,
    median_number,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

Getter = Callable[[RunResult], float | None]
ABSENT = "—"


class PlotUnavailableError(RuntimeError):
    """`--plot` needs matplotlib, which the `bench` extra installs."""


def _dist_getter(key: str, stat: str) -> Getter:
    return lambda r: getattr(getattr(r.summary, key), stat)


def _dist_rows(label: str, key: str) -> list[tuple[str, Getter, str, float]]:
    return [
        (f"{label} {stat} (ms)", _dist_getter(key, stat), "{:.2f}", 1e3)
        for stat in ("mean", "median", "p90", "p99")
    ]


def _stall_getter(attr: str) -> Getter:
    return lambda r: None if r.stallfree is None else getattr(r.stallfree, attr)


def _site_getter(site: str) -> Getter:
    def get(r: RunResult) -> float | None:
        per_step = None if r.stallfree is None else r.stallfree.stalls_per_step
        if per_step is None:
            return None
        return per_step.get(site, 0.0)

    return get


def _rank_getter(rank: str, attr: str) -> Getter:
    def get(r: RunResult) -> float | None:
        workers = None if r.stallfree is None else r.stallfree.workers
        figures = None if workers is None else workers.get(rank)
        return None if figures is None else getattr(figures, attr)

    return get


def _worker_rows(results: list[RunResult]) -> list[tuple[str, Getter, str, float]]:
    """Per worker rank (modes with worker processes; absent in the others): step time, the
    collectives' share of it, and the bytes per step the scheduler sends (rank 0)."""
    ranks = sorted(
        {
            rank
            for r in results
            if r.stallfree and r.stallfree.workers
            for rank in r.stallfree.workers
        },
        key=int,
    )
    rows: list[tuple[str, Getter, str, float]] = []
    for rank in ranks:
        rows += [
            (f"rank {rank} step time (ms)", _rank_getter(rank, "mean_step_seconds"), "{:.3f}", 1e3),
            (
                f"rank {rank} all-reduce + gather share of step",
                _rank_getter(rank, "comm_share"),
                "{:.1%}",
                1,
            ),
        ]
    if ranks:
        rows.append(
            (
                "bytes per step sent to the workers",
                _rank_getter(ranks[0], "message_bytes_per_step"),
                "{:.0f}",
                1,
            )
        )
    return rows


def _spec_getter(attr: str) -> Getter:
    def get(r: RunResult) -> float | None:
        spec = None if r.stallfree is None else r.stallfree.spec
        return None if spec is None else getattr(spec, attr)

    return get


def _position_getter(position: str) -> Getter:
    def get(r: RunResult) -> float | None:
        spec = None if r.stallfree is None else r.stallfree.spec
        per_pos = None if spec is None else spec.acceptance_rate_per_pos
        return None if per_pos is None else per_pos.get(position)

    return get


def _spec_rows(results: list[RunResult]) -> list[tuple[str, Getter, str, float]]:
    """Speculative decoding (modes with it on; absent in the others): draft and accepted
    tokens, acceptance rate and mean acceptance length, and the rate by draft position."""
    specs = [r.stallfree.spec for r in results if r.stallfree and r.stallfree.spec]
    if not specs:
        return []
    positions = sorted({p for s in specs for p in s.acceptance_rate_per_pos or {}}, key=int)
    return [
        ("spec decode draft tokens", _spec_getter("num_draft_tokens"), "{:.0f}", 1),
        ("spec decode accepted tokens", _spec_getter("num_accepted_tokens"), "{:.0f}", 1),
        ("spec decode acceptance rate", _spec_getter("acceptance_rate"), "{:.1%}", 1),
        ("spec decode mean acceptance length", _spec_getter("mean_acceptance_length"), "{:.2f}", 1),
        *[
            (f"  acceptance rate: position {p}", _position_getter(p), "{:.1%}", 1)
            for p in positions
        ],
        ("spec decode requests disabled", _spec_getter("requests_disabled"), "{:.0f}", 1),
    ]


def table_rows(results: list[RunResult]) -> list[tuple[str, Getter, str, float]]:
    """(label, value getter, format, scale) for every figure the table shows."""
    rows: list[tuple[str, Getter, str, float]] = [
        ("completed requests", lambda r: r.summary.completed, "{:.0f}", 1),
        ("failed requests", lambda r: r.summary.failed, "{:.0f}", 1),
        ("duration (s)", lambda r: r.summary.duration_s, "{:.2f}", 1),
        ("request throughput (req/s)", lambda r: r.summary.request_throughput, "{:.2f}", 1),
        ("input throughput (tok/s)", lambda r: r.summary.input_throughput, "{:.1f}", 1),
        ("output throughput (tok/s)", lambda r: r.summary.output_throughput, "{:.1f}", 1),
        ("total throughput (tok/s)", lambda r: r.summary.total_throughput, "{:.1f}", 1),
        *_dist_rows("TTFT", "ttft"),
        *_dist_rows("ITL", "itl"),
        *_dist_rows("TPOT", "tpot"),
        *_dist_rows("E2E", "e2e"),
        ("peak concurrency", lambda r: r.summary.peak_concurrency, "{:.0f}", 1),
        ("steps", _stall_getter("steps"), "{:.0f}", 1),
        ("overlap steps", _stall_getter("overlap_steps"), "{:.0f}", 1),
        ("stalls per step (all sites)", _per_step_total, "{:.3f}", 1),
    ]
    sites = sorted({site for r in results if r.stallfree for site in r.stallfree.sites})
    rows += [(f"  stalls per step: {site}", _site_getter(site), "{:.3f}", 1) for site in sites]
    rows += [
        ("stall time (s)", _stall_getter("stall_seconds"), "{:.4f}", 1),
        ("device busy (s)", _stall_getter("device_busy_seconds"), "{:.2f}", 1),
        ("device idle fraction", _stall_getter("device_idle_fraction"), "{:.3f}", 1),
        ("mean schedule time (ms)", _stall_getter("mean_schedule_seconds"), "{:.3f}", 1e3),
        ("prefix cache hit rate", _stall_getter("prefix_cache_hit_rate"), "{:.1%}", 1),
        *_spec_rows(results),
        *_worker_rows(results),
    ]
    return rows


def _per_step_total(r: RunResult) -> float | None:
    """Derived per run, so over repeats it is the median of the runs' values."""
    if r.repeats:
        return median_number([_per_step_total(x) for x in r.repeats])
    f = r.stallfree
    if f is None or f.stalls_total is None or not f.steps:
        return None
    return f.stalls_total / f.steps


def _cell(value: float | None, base: float | None, fmt: str, scale: float, first: bool) -> str:
    if value is None:
        return ABSENT
    text = fmt.format(value * scale)
    if first:
        return text
    if base is None or base == 0:
        return text if value == 0 else f"{text} ({ABSENT})"
    return f"{text} ({value / base:.2f}x)"


def spread_row(results: list[RunResult]) -> list[str] | None:
    """Output throughput per run, lowest to highest, for each mode; None for single runs."""
    if all(len(r.runs) < 2 for r in results):
        return None
    cells = []
    for r in results:
        values = [x.summary.output_throughput for x in r.runs]
        cells.append(f"{min(values):.1f} – {max(values):.1f}")
    return cells


def render_table(results: list[RunResult], title: str | None = None) -> Table:
    from rich.table import Table  # rich comes with the bench extra, not the base install

    table = Table(title=title, title_justify="left")
    table.add_column("figure", no_wrap=True)
    for i, r in enumerate(results):
        table.add_column(r.mode if i == 0 else f"{r.mode} (x base)", justify="right")
    for label, get, fmt, scale in table_rows(results):
        base = get(results[0])
        cells = [_cell(get(r), base, fmt, scale, i == 0) for i, r in enumerate(results)]
        table.add_row(label, *cells)
        if label.startswith("output throughput"):
            spread = spread_row(results)
            if spread is not None:
                table.add_row("  spread over runs (tok/s)", *spread)
    return table


def print_table(results: list[RunResult], title: str, console: Console | None = None) -> None:
    from rich.console import Console

    console = console or Console(width=None if Console().is_terminal else 200)
    console.print(title, highlight=False, soft_wrap=True)
    console.print(render_table(results))
    notes = [f"{r.mode}: {e}" for r in results for e in r.errors[:3]]
    for note in notes:
        console.print(f"[red]error[/red] {note}", highlight=False)


def _request_dict(record: RequestRecord) -> dict[str, Any]:
    out = {**asdict(record), "tpot": record.tpot}
    out.pop("generated_text")  # the texts go in --save-detailed's `generated_texts` only
    return out


# vLLM's name of each latency that `vllm bench serve` and this bench both measure
VLLM_LATENCIES = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def vllm_figures(s: RunSummary) -> dict[str, Any]:
    """The figures of a run under the key names of `vllm bench serve`'s result file: seconds
    for `duration`, milliseconds for latencies (`mean_ttft_ms`, `p99_itl_ms`, ...). A latency
    with no sample is null, where vLLM would write 0."""
    out: dict[str, Any] = {
        "duration": s.duration_s,
        "completed": s.completed,
        "failed": s.failed,
        "total_input_tokens": s.total_input_tokens,
        "total_output_tokens": s.total_output_tokens,
        "request_throughput": s.request_throughput,
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_throughput,
        "max_concurrent_requests": s.peak_concurrency,
    }
    for name, key in VLLM_LATENCIES.items():
        d: Distribution = getattr(s, key)
        for stat in ("mean", "median", "std"):
            out[f"{stat}_{name}_ms"] = _ms(getattr(d, stat))
        out[f"p90_{name}_ms"] = _ms(d.p90)
        out[f"p99_{name}_ms"] = _ms(d.p99)
    return out


def _summary_json(s: RunSummary) -> dict[str, Any]:
    """Today's keys (seconds) and vLLM's (`vllm_figures`); the shared ones agree."""
    return {**asdict(s), **vllm_figures(s)}


Extras = Callable[[RunResult], dict[str, Any]]


def to_json(
    results: list[RunResult],
    config: dict[str, Any],
    header: dict[str, Any] | None = None,
    extras: Extras | None = None,
    detailed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`runs[]` has one entry per mode: its figures (the medians, with several repeats) and
    `repeats[]`, every run behind them in full; a single run also keeps `requests` there.

    `header` (vLLM's `date`, `backend`, `model_id`, ...) goes first. With a single mode its
    figures are at the top level too, under vLLM's names, as `vllm bench serve` writes them.
    `extras(run)` adds figures (goodput, chosen percentiles) to every summary and to the top
    with it; `detailed` (per-request lists) goes at the top."""
    from stallfree import __version__

    repeats = max(len(r.runs) for r in results)
    top = dict(header or {})
    if len(results) == 1:
        top.update(vllm_figures(results[0].summary))
        top.update(extras(results[0]) if extras else {})
        top.update(detailed or {})
    return {
        **top,
        "stallfree_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "config": config,
        "baseline": results[0].mode,
        "repeats": repeats,
        "aggregate": "median",
        "runs": [_mode_json(r, results, repeats, extras) for r in results],
    }


def _mode_json(
    r: RunResult, results: list[RunResult], repeats: int, extras: Extras | None
) -> dict[str, Any]:
    out = {
        "mode": r.mode,
        "settings": r.settings,
        "summary": {**_summary_json(r.summary), **(extras(r) if extras else {})},
        "stallfree": None if r.stallfree is None else asdict(r.stallfree),
        "ratios_to_baseline": _ratios(r, results[0], results),
        "errors": r.errors,
        "repeats": [_run_json(x, extras) for x in r.runs],
    }
    if repeats == 1:
        out["requests"] = [_request_dict(x) for x in r.requests]
    return out


def _run_json(r: RunResult, extras: Extras | None = None) -> dict[str, Any]:
    return {
        "repeat": r.repeat,
        "sequence": r.sequence,
        "started_at": r.started_at,
        "finished_at": r.finished_at,
        "summary": {**_summary_json(r.summary), **(extras(r) if extras else {})},
        "stallfree": None if r.stallfree is None else asdict(r.stallfree),
        "errors": r.errors,
        "requests": [_request_dict(x) for x in r.requests],
    }


def _ratios(r: RunResult, base: RunResult, results: list[RunResult]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for label, get, _, _ in table_rows(results):
        value, ref = get(r), get(base)
        out[label.strip()] = None if value is None or not ref else value / ref
    return out


def write_json(
    path: str | Path,
    results: list[RunResult],
    config: dict[str, Any],
    header: dict[str, Any] | None = None,
    extras: Extras | None = None,
    detailed: dict[str, Any] | None = None,
) -> None:
    data = to_json(results, config, header, extras, detailed)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'stallfree[bench]'"
        ) from None


def write_plot(path: str | Path, results: list[RunResult], title: str) -> None:
    """Latency CDFs (TTFT, ITL, E2E) on top, every repeat's requests pooled; stall time, device
    idle fraction and output throughput per mode (medians over the repeats) below."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    fig.suptitle(title)
    _latency_cdfs(axes[0], results)
    names = [r.mode for r in results]
    _bars(axes[1][0], names, [_stall_getter("stall_seconds")(r) for r in results], "stall time (s)")
    _bars(
        axes[1][1],
        names,
        [_stall_getter("device_idle_fraction")(r) for r in results],
        "device idle fraction",
    )
    _bars(axes[1][2], names, [r.summary.output_throughput for r in results], "output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _latency_cdfs(axes: Any, results: list[RunResult]) -> None:
    import numpy as np
    from matplotlib.ticker import NullFormatter

    panels: tuple[tuple[str, Callable[[RunResult], list[float]]], ...] = (
        ("TTFT", lambda r: [x.ttft for x in r.requests if x.success and x.ttft is not None]),
        ("ITL", lambda r: [i for x in r.requests if x.success for i in x.itls]),
        ("E2E latency", lambda r: [x.e2e for x in r.requests if x.success and x.e2e is not None]),
    )
    for ax, (name, values) in zip(axes, panels, strict=True):
        for r in results:
            data = np.sort(np.asarray(values(r), dtype=np.float64)) * 1e3
            if data.size:
                ax.plot(data, np.arange(1, data.size + 1) / data.size, label=r.mode)
        pooled = max(len(r.runs) for r in results)
        ax.set_title(f"{name} distribution" + (f", {pooled} runs pooled" if pooled > 1 else ""))
        if name == "ITL":
            ax.set_xscale("log")  # a few long gaps (prefill steps) would squash the rest
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _bars(ax: Any, names: list[str], values: list[float | None], title: str) -> None:
    xs = range(len(names))
    heights = [0.0 if v is None else v for v in values]
    bars = ax.bar(xs, heights, color=[f"C{i}" for i in xs])
    for bar, v in zip(bars, values, strict=True):
        label = "absent" if v is None else f"{v:.3g}"
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=15, ha="right", fontsize=8)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
