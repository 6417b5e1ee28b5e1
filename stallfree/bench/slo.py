"""The figures of `vllm bench serve` beyond the table: request goodput under `--goodput` SLOs,
the `--percentile-metrics` x `--metric-percentiles` keys, the `--save-detailed` per-request
lists; and the value types of those flags and of `--metadata`."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import TYPE_CHECKING, Any

from stallfree.bench.results import RequestRecord, RunResult

if TYPE_CHECKING:
    from rich.console import Console

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
DEFAULT_METRIC_PERCENTILES = "99"


def goodput_item(text: str) -> tuple[str, float]:
    """One `--goodput` item, `KEY:MS` with KEY ttft, tpot or e2el and MS a number >= 0."""
    key, sep, value = text.partition(":")
    if not sep or key not in GOODPUT_KEYS:
        raise argparse.ArgumentTypeError(
            f"invalid SLO {text!r}: the name before ':' must be one of "
            f"{', '.join(GOODPUT_KEYS)} (e.g. ttft:500)"
        )
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not ms >= 0 or math.isinf(ms):
        raise argparse.ArgumentTypeError(
            f"invalid SLO {text!r}: {value!r} is not a number of milliseconds >= 0"
        )
    return key, ms


def metadata_item(text: str) -> tuple[str, str]:
    """One `--metadata` item, `KEY=VALUE`."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"invalid metadata {text!r}: expected KEY=VALUE")
    return key.strip(), value.strip()


def percentile_metrics(text: str) -> list[str]:
    """`--percentile-metrics`: a comma list from ttft, tpot, itl, e2el."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in PERCENTILE_METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"invalid metric(s) {unknown or text!r}: choose from {', '.join(PERCENTILE_METRICS)}"
        )
    return names


def metric_percentiles(text: str) -> list[float]:
    """`--metric-percentiles`: a comma list of percentiles in [0, 100], e.g. 50,90,99.9."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(
            f"invalid percentiles {text!r}: a comma list of numbers in [0, 100], e.g. 50,90,99"
        )
    return values


def percentile_key(p: float, metric: str) -> str:
    """vLLM's key: `p99_ttft_ms`, `p99.9_ttft_ms` (whole percentiles without a decimal point)."""
    name = str(int(p)) if int(p) == p else str(p)
    return f"p{name}_{metric}_ms"


def _tpot_or_zero(r: RequestRecord) -> float:
    """vLLM counts a request with one output token as TPOT 0 for goodput."""
    t = r.tpot
    return 0.0 if t is None else t


def _metric_values(records: list[RequestRecord], metric: str) -> list[float]:
    """The samples of one metric over the successful requests, in seconds."""
    ok = [r for r in records if r.success]
    if metric == "ttft":
        return [r.ttft for r in ok if r.ttft is not None]
    if metric == "tpot":
        return [t for r in ok if (t := r.tpot) is not None]
    if metric == "itl":
        return [x for r in ok for x in r.itls]
    return [r.e2e for r in ok if r.e2e is not None]


def good_requests(records: list[RequestRecord], slos: dict[str, float]) -> int:
    """Successful requests meeting every SLO (milliseconds): ttft, tpot and e2el <= the limit."""
    good = 0
    for r in records:
        if not r.success or r.ttft is None or r.e2e is None:
            continue
        measured = {"ttft": r.ttft, "tpot": _tpot_or_zero(r), "e2el": r.e2e}
        if all(measured[k] * 1e3 <= ms for k, ms in slos.items()):
            good += 1
    return good


def request_goodput(
    records: list[RequestRecord], duration_s: float, slos: dict[str, float]
) -> float:
    """Requests per second meeting every SLO, over the whole run's duration."""
    return good_requests(records, slos) / duration_s if duration_s > 0 else 0.0


def percentile_figures(
    records: list[RequestRecord], metrics: list[str], percentiles: list[float]
) -> dict[str, float | None]:
    """`pNN_X_ms` for each chosen metric and percentile (numpy's linear percentile, as vLLM);
    null for a metric with no sample."""
    import numpy as np  # the bench extra

    out: dict[str, float | None] = {}
    for metric in metrics:
        values = np.asarray(_metric_values(records, metric), dtype=np.float64)
        for p in percentiles:
            key = percentile_key(p, metric)
            out[key] = float(np.percentile(values, p)) * 1e3 if values.size else None
    return out


def _one_run(
    run: RunResult, slos: dict[str, float] | None, metrics: list[str], percentiles: list[float]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "request_goodput": None
        if slos is None
        else request_goodput(run.requests, run.summary.duration_s, slos)
    }
    out.update(percentile_figures(run.requests, metrics, percentiles))
    return out


def run_figures(
    result: RunResult,
    slos: dict[str, float] | None,
    metrics: list[str],
    percentiles: list[float],
) -> dict[str, Any]:
    """`request_goodput` (null without SLOs) and the percentile keys of one mode; over several
    repeats each is the median of the runs' values, as the table's figures are."""
    per_run = [_one_run(r, slos, metrics, percentiles) for r in result.runs]
    out: dict[str, Any] = {}
    for key in per_run[0]:
        values = [x[key] for x in per_run if x[key] is not None]
        out[key] = float(statistics.median(values)) if values else None
    return out


def detailed_lists(result: RunResult) -> dict[str, list[Any]]:
    """`--save-detailed`: per request, in the order sent, vLLM's lists (seconds; a failed
    request has ttft 0 and output length 0, as vLLM writes them)."""
    reqs = result.requests
    return {
        "input_lens": [r.prompt_len for r in reqs],
        "output_lens": [r.output_tokens if r.success else 0 for r in reqs],
        "ttfts": [r.ttft if r.success and r.ttft is not None else 0.0 for r in reqs],
        "itls": [list(r.itls) if r.success else [] for r in reqs],
        "generated_texts": [r.generated_text for r in reqs],
        "errors": [r.error or "" for r in reqs],
    }


def print_figures(
    console: Console, results: list[RunResult], figures: list[dict[str, Any]]
) -> None:
    """The goodput (when SLOs were given) and chosen percentiles per mode, under the table."""
    for r, f in zip(results, figures, strict=True):
        prefix = f"{r.mode}: " if len(results) > 1 else ""
        if f.get("request_goodput") is not None:
            console.print(f"{prefix}request goodput (req/s): {f['request_goodput']:.2f}")
        cells = [
            f"{k.removesuffix('_ms')} {v:.2f}"
            for k, v in f.items()
            if k.startswith("p") and v is not None
        ]
        if cells:
            console.print(f"{prefix}percentiles (ms): {', '.join(cells)}", highlight=False)
