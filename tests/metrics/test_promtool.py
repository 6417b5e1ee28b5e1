"""Prometheus' own checks, where `promtool` is installed (CI installs Debian's `prometheus`).

1. `promtool check metrics` on real scrapes finds nothing but what vLLM's names share: the `:`
   in every name, and `_total` on the `iteration_tokens_total` histogram (vLLM's name).
2. `promtool test rules` evaluates the dashboard's HiSparse and hit-rate expressions against
   series from a real scrape: 0 when HiSparse is off, the right ratio when it is on.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stallfree import Engine, SamplingParams
from stallfree.metrics import EngineMetrics
from tests.engine_util import engine_config, random_prompts

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
COLON_RULE = "metric names should not contain ':'"
# vLLM's name for a histogram; promtool reserves `_total` for counters
VLLM_TOTAL_HISTOGRAM = (
    'stallfree:iteration_tokens_total non-counter metrics should not have "_total" suffix'
)


def check_metrics(text: bytes) -> list[str]:
    """promtool's findings on a scrape, one per line."""
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    lines = (done.stdout + done.stderr).decode().splitlines()
    assert done.returncode in (0, 3), lines  # 3: lint findings; anything else: it failed
    return [line for line in lines if line.strip()]


async def _scrape(config_sections: dict) -> tuple[bytes, int, int]:
    """A real engine after a small workload, and a second one in the same registry; the
    families the scrape declares, and those of them with a series (promtool reads only those:
    with speculation off, the per-position family has none)."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    async with (
        Engine(engine_config("tiny", **config_sections)) as a,
        Engine(engine_config("tiny", metrics={"enabled": False})) as b,
    ):
        assert a.metrics is not None and isinstance(a.metrics, EngineMetrics)
        second = EngineMetrics("tiny", "second", b.snapshot, registry=a.metrics.registry)
        b.add_observer(second)
        prompts = random_prompts(3, lo=30, hi=40)
        await asyncio.gather(*(e.complete(p, params) for e in (a, b) for p in prompts))
        await a.wait_idle()
        await b.wait_idle()
        text = a.metrics.render()
    families = list(text_string_to_metric_families(text.decode()))
    return text, len(families), len([f for f in families if f.samples])


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"runtime": {"cpu_mirrors": False}},  # legacy: real stalls
        {"hisparse": {"enabled": True, "top_k": 8, "device_buffer_size": 16}},
        {"speculative": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["default", "legacy", "hisparse", "speculative"],
)
async def test_promtool_finds_only_the_names_vllm_shares(sections):
    text, families, with_series = await _scrape(sections)
    findings = check_metrics(text)
    colon = [f for f in findings if f.endswith(COLON_RULE)]
    assert len(colon) == with_series > 30  # promtool read every family with a series, once
    # only the per-position speculative family can be empty: speculation off, no position
    assert families - with_series == (0 if "speculative" in sections else 1)
    assert [f for f in findings if f not in colon] == [VLLM_TOTAL_HISTOGRAM]
    # two engines, one family each: a repeated HELP would be a parse error, not a finding
    helps = [line for line in text.decode().splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps)) == families


def test_promtool_reports_a_gauge_named_like_a_counter():
    """The check above can fail: the old gauge name is exactly what promtool flags."""
    bad = b"# HELP x_pool_total slots\n# TYPE x_pool_total gauge\nx_pool_total 1\n"
    assert check_metrics(bad) == [
        'x_pool_total non-counter metrics should not have "_total" suffix'
    ]


# ---------------------------------------------------------------------- dashboard expressions


def _panel_exprs(panel_id: int) -> list[str]:
    """The panel's PromQL, with Grafana's variables filled in: every model, every engine."""
    board = json.loads(DASHBOARD.read_text())
    panel = next(p for p in board["panels"] if p["id"] == panel_id)
    return [
        t["expr"]
        .replace("$model_name", ".*")
        .replace("$engine", ".*")
        .replace("$__rate_interval", "5m")
        for t in panel["targets"]
    ]


HISPARSE_HIT_RATE, HISPARSE_BYTES, HISPARSE_POOL, PREFIX_HIT_RATE, TOKENS_PER_STEP = (
    19,
    20,
    21,
    22,
    26,
)
SPEC_ACCEPTANCE_RATE, SPEC_ACCEPTANCE_LENGTH, SPEC_PER_POSITION, SPEC_TOKENS = 28, 29, 30, 31


def _series(text: bytes) -> list[dict[str, str]]:
    """Every sample of a scrape as a constant input series (nothing moves: every rate is 0)."""
    out = []
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out.append({"series": f"{s.name}{{{labels}}}", "values": f"{s.value!r}+0x10"})
    return out


def run_rule_test(tmp_path: Path, series: list[dict[str, str]], cases: list[dict]) -> None:
    assert PROMTOOL is not None
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": cases}],
    }
    path = tmp_path / "dashboard_test.yml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    done = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _case(expr: str, *samples: tuple[str, float]) -> dict:
    return {
        "expr": expr,
        "eval_time": "10m",
        "exp_samples": [{"labels": labels, "value": v} for labels, v in samples],
    }


async def test_hisparse_panels_show_zero_when_hisparse_is_off(tmp_path):
    async with Engine(engine_config("tiny")) as engine:
        await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        await engine.wait_idle()
        assert engine.metrics is not None
        text = generate_latest(engine.metrics.registry)
    (hit_rate,) = _panel_exprs(HISPARSE_HIT_RATE)
    (moved,) = _panel_exprs(HISPARSE_BYTES)
    (pool,) = _panel_exprs(HISPARSE_POOL)
    (prefix,) = _panel_exprs(PREFIX_HIT_RATE)
    mean_tokens = _panel_exprs(TOKENS_PER_STEP)[-1]
    run_rule_test(
        tmp_path,
        _series(text),
        [
            _case(hit_rate, ("{}", 0)),
            _case(moved, ('{direction="d2h"}', 0), ('{direction="h2d"}', 0)),
            _case(pool, ("{}", 0)),
            _case(prefix, ("{}", 0)),
            _case(mean_tokens, ("{}", 0)),
        ],
    )


def test_hisparse_panels_follow_the_counters_when_hisparse_is_on(tmp_path):
    labels = 'model_name="m",engine="0"'
    series = [
        {"series": f"stallfree:hisparse_hits_total{{{labels}}}", "values": "0+10x10"},
        {"series": f"stallfree:hisparse_misses_total{{{labels}}}", "values": "0+30x10"},
        {"series": f"stallfree:hisparse_host_pool_used{{{labels}}}", "values": "16+0x10"},
        {"series": f"stallfree:hisparse_host_pool_capacity{{{labels}}}", "values": "64+0x10"},
        {"series": f"stallfree:prefix_cache_queries_total{{{labels}}}", "values": "0+40x10"},
        {"series": f"stallfree:prefix_cache_hits_total{{{labels}}}", "values": "0+10x10"},
    ]
    (hit_rate,) = _panel_exprs(HISPARSE_HIT_RATE)
    (pool,) = _panel_exprs(HISPARSE_POOL)
    (prefix,) = _panel_exprs(PREFIX_HIT_RATE)
    run_rule_test(
        tmp_path,
        series,
        [_case(hit_rate, ("{}", 0.25)), _case(pool, ("{}", 0.25)), _case(prefix, ("{}", 0.25))],
    )


def _ratio_exprs(title: str) -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in board["panels"] if p.get("title") == title]
    return [e for e in _panel_exprs(panel["id"]) if " / " in e]


async def test_ratio_panels_show_zero_on_an_idle_engine(tmp_path):
    """Every rate is 0 on an idle engine: a ratio of rates must show 0, not NaN or no data."""
    async with Engine(engine_config("tiny")) as engine:
        await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        await engine.wait_idle()
        assert engine.metrics is not None
        text = generate_latest(engine.metrics.registry)
    cases = [
        _case(expr, ("{}", 0))
        for title in (
            "Schedule time (host, per batch)",
            "Device idle fraction (while requests wait)",
            "Overlapped launches",
        )
        for expr in _ratio_exprs(title)
    ]
    assert len(cases) == 3
    run_rule_test(tmp_path, _series(text), cases)


# ---------------------------------------------------------------------- speculative decoding


async def _idle_scrape(**sections: dict) -> bytes:
    async with Engine(engine_config("tiny", **sections)) as engine:
        await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        await engine.wait_idle()
        assert engine.metrics is not None
        return generate_latest(engine.metrics.registry)


@pytest.mark.parametrize("spec", [False, True], ids=["off", "on"])
async def test_speculative_panels_show_zero_without_drafts(tmp_path, spec):
    """Speculation off, or on with nothing drafted: the ratios are 0, not NaN; the positions
    are there only with speculation on (k of them, each 0)."""
    sections = {"speculative": {"method": "ngram", "num_speculative_tokens": 3}} if spec else {}
    text = await _idle_scrape(**sections)
    (rate,) = _panel_exprs(SPEC_ACCEPTANCE_RATE)
    (length,) = _panel_exprs(SPEC_ACCEPTANCE_LENGTH)
    (per_pos,) = _panel_exprs(SPEC_PER_POSITION)
    positions = [(f'{{position="{i}"}}', 0) for i in range(3)] if spec else []
    cases = [_case(rate, ("{}", 0)), _case(length, ("{}", 0)), _case(per_pos, *positions)]
    cases += [_case(e, ("{}", 0)) for e in _panel_exprs(SPEC_TOKENS)]
    run_rule_test(tmp_path, _series(text), cases)


def test_speculative_panels_follow_the_counters(tmp_path):
    """Per minute: 16 drafts of 32 tokens, 14 accepted (8, 4 and 2 at positions 0, 1, 2)."""
    labels = 'model_name="m",engine="0"'
    name = "stallfree:spec_decode_"
    per_pos = name + "num_accepted_tokens_per_pos_total"
    series = [
        {"series": f"{name}num_drafts_total{{{labels}}}", "values": "0+16x10"},
        {"series": f"{name}num_draft_tokens_total{{{labels}}}", "values": "0+32x10"},
        {"series": f"{name}num_accepted_tokens_total{{{labels}}}", "values": "0+14x10"},
        {"series": f"{name}requests_disabled_total{{{labels}}}", "values": "0+0x10"},
    ]
    series += [
        {"series": f'{per_pos}{{{labels},position="{i}"}}', "values": f"0+{n}x10"}
        for i, n in enumerate((8, 4, 2))
    ]
    (rate,) = _panel_exprs(SPEC_ACCEPTANCE_RATE)
    (length,) = _panel_exprs(SPEC_ACCEPTANCE_LENGTH)
    (by_position,) = _panel_exprs(SPEC_PER_POSITION)
    positions = [(f'{{position="{i}"}}', v) for i, v in enumerate((0.5, 0.25, 0.125))]
    run_rule_test(
        tmp_path,
        series,
        [
            _case(rate, ("{}", 14 / 32)),
            _case(length, ("{}", 1 + 14 / 16)),
            _case(by_position, *positions),
        ],
    )
