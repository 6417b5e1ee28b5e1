"""`stallfree bench`'s speculative-decoding figures: computed from counter deltas, the same from
the engine's snapshot and from `/metrics`, absent with speculation off, in the table and JSON."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, replace
from typing import Any

import httpx
import pytest

from stallfree.bench.counters import (
    SpecCounters,
    SpecFigures,
    StallFigures,
    snapshot_engine,
    snapshot_prometheus,
    spec_figures,
    stall_figures,
)
from stallfree.bench.datasets import build_requests
from stallfree.bench.http_targets import HttpTarget
from stallfree.bench.report import ABSENT, render_table, table_rows, to_json
from stallfree.bench.results import RequestRecord, RunResult, median_of, summarize
from stallfree.bench.runner import Mode, RunSettings, run_mode
from stallfree.bench.workloads import WorkloadSpec
from stallfree.metrics import EngineMetrics
from stallfree.runtime.telemetry.stats import EngineSnapshot, SpecStats
from tests.metrics_util import fake_snapshot

# before the run: 2 drafts of 6 tokens, 3 accepted (2 and 1 at positions 0 and 1)
BEFORE = SpecStats("ngram", 3, num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3)
BEFORE = replace(BEFORE, accepted_per_pos=(2, 1, 0), requests_disabled=1)
# during it: 10 drafts of 30 tokens, 20 accepted (8, 7 and 5 at positions 0, 1 and 2)
AFTER = SpecStats("ngram", 3, num_drafts=12, num_draft_tokens=36, num_accepted_tokens=23)
AFTER = replace(AFTER, accepted_per_pos=(10, 8, 5), requests_disabled=3)
EXPECTED = SpecFigures(
    num_drafts=10,
    num_draft_tokens=30,
    num_accepted_tokens=20,
    acceptance_rate=20 / 30,
    mean_acceptance_length=1 + 20 / 10,
    acceptance_rate_per_pos={"0": 0.8, "1": 0.7, "2": 0.5},
    requests_disabled=2,
)


def _flat(figures: SpecFigures | None) -> dict[str, Any]:
    """The figures as one flat dict of numbers, for `pytest.approx`."""
    assert figures is not None
    out = asdict(figures)
    per_pos = out.pop("acceptance_rate_per_pos") or {}
    return out | {f"position {k}": v for k, v in per_pos.items()}


def test_figures_from_counter_deltas() -> None:
    before = SpecCounters(2, 6, 3, [2, 1], 1)  # a shorter list: position 2 not reached yet
    after = SpecCounters(12, 36, 23, [10, 8, 5], 3)
    figures = spec_figures(before, after)
    assert figures is not None
    assert _flat(figures) == pytest.approx(_flat(EXPECTED))
    assert figures.acceptance_rate == pytest.approx(2 / 3)
    assert figures.mean_acceptance_length == pytest.approx(3.0)
    # speculation off (or not a stallfree target) at either end: no figures at all
    assert spec_figures(None, after) is None and spec_figures(before, None) is None


def test_nothing_drafted_leaves_the_ratios_absent_not_zero() -> None:
    counters = SpecCounters(4, 12, 6, [4, 2], 0)
    figures = spec_figures(counters, counters)
    assert figures == SpecFigures(
        num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, requests_disabled=0
    )
    assert figures.acceptance_rate is None and figures.mean_acceptance_length is None
    assert figures.acceptance_rate_per_pos is None


class _FakeEngine:
    def __init__(self, snap: EngineSnapshot) -> None:
        self.snap = snap

    def snapshot(self) -> EngineSnapshot:
        return self.snap


def _scrape(snap: EngineSnapshot) -> str:
    return EngineMetrics("m", "0", lambda: snap).render().decode()


@pytest.mark.parametrize("spec", [True, False], ids=["on", "off"])
def test_engine_snapshot_and_metrics_give_the_same_figures(spec: bool) -> None:
    before = fake_snapshot(spec=BEFORE if spec else None)
    after = fake_snapshot(spec=AFTER if spec else None)
    engine = stall_figures(
        snapshot_engine(_FakeEngine(before)),  # type: ignore[arg-type]
        snapshot_engine(_FakeEngine(after)),  # type: ignore[arg-type]
    )
    http_before = snapshot_prometheus(_scrape(before))
    http_after = snapshot_prometheus(_scrape(after))
    assert http_before is not None and http_after is not None
    http = stall_figures(http_before, http_after)
    if not spec:
        # the counters are exported at 0, but no draft position: speculation is off
        assert http_after.spec is None and engine.spec is None and http.spec is None
        return
    assert http_after.spec == SpecCounters(12, 36, 23, [10, 8, 5], 3)
    assert _flat(engine.spec) == pytest.approx(_flat(EXPECTED))
    assert _flat(http.spec) == pytest.approx(_flat(EXPECTED))


def _result(mode: str, spec: SpecFigures | None) -> RunResult:
    record = RequestRecord(4, 3, success=True, input_tokens=4, output_tokens=3)
    record.ttft, record.e2e = 0.1, 0.3
    figures = StallFigures(steps=10.0, spec=spec)
    return RunResult(mode, {}, summarize([record], 1.0, 1), figures, [record])


def _rows(results: list[RunResult]) -> dict[str, list[str]]:
    table = render_table(results, "t")
    columns = [list(c.cells) for c in table.columns]
    return {row[0]: list(row[1:]) for row in zip(*columns, strict=True)}


def test_table_and_json_show_the_figures_and_nothing_with_speculation_off() -> None:
    off, on = _result("off", None), _result("ngram", EXPECTED)
    rows = _rows([off, on])
    assert rows["spec decode draft tokens"] == [ABSENT, f"30 ({ABSENT})"]
    assert rows["spec decode accepted tokens"] == [ABSENT, f"20 ({ABSENT})"]
    assert rows["spec decode acceptance rate"] == [ABSENT, f"66.7% ({ABSENT})"]
    assert rows["spec decode mean acceptance length"] == [ABSENT, f"3.00 ({ABSENT})"]
    assert rows["  acceptance rate: position 2"] == [ABSENT, f"50.0% ({ABSENT})"]
    assert rows["spec decode requests disabled"] == [ABSENT, f"2 ({ABSENT})"]
    # no mode speculates: no rows at all
    assert not [label for label, *_ in table_rows([off]) if "spec" in label]

    data = json.loads(json.dumps(to_json([off, on], {})))
    assert data["runs"][0]["stallfree"]["spec"] is None
    spec = data["runs"][1]["stallfree"]["spec"]
    assert spec["num_draft_tokens"] == 30 and spec["num_accepted_tokens"] == 20
    assert spec["acceptance_rate"] == pytest.approx(2 / 3)
    assert spec["mean_acceptance_length"] == pytest.approx(3.0)
    assert spec["acceptance_rate_per_pos"] == pytest.approx({"0": 0.8, "1": 0.7, "2": 0.5})
    assert data["runs"][1]["repeats"][0]["stallfree"]["spec"] == spec
    # a single speculating mode: its own figures, no ratio to compare with
    (run,) = to_json([on], {})["runs"]
    assert run["ratios_to_baseline"]["spec decode mean acceptance length"] == 1.0


def test_median_over_repeats_is_per_figure() -> None:
    runs = [
        StallFigures(spec=SpecFigures(10, 30, 15, 0.5, 2.5, {"0": 0.9}, 0)),
        StallFigures(spec=SpecFigures(20, 60, 40, 2 / 3, 3.0, {"0": 0.7}, 1)),
        StallFigures(spec=SpecFigures(30, 90, 30, 1 / 3, 2.0, {"0": 0.8}, 2)),
    ]
    spec = median_of(StallFigures, runs).spec
    assert spec == SpecFigures(20, 60, 30, 0.5, 2.5, {"0": 0.8}, 1)
    assert median_of(StallFigures, [StallFigures(), StallFigures()]).spec is None


# ---------------------------------------------------------------- through a run


class _SpeculatingServer:
    """A completions server whose `/metrics` is a stallfree scrape: each request adds one
    draft of 3 tokens, 2 of them accepted (positions 0 and 1)."""

    def __init__(self) -> None:
        self.spec = SpecStats("ngram", 3, accepted_per_pos=(0, 0, 0))
        self.metrics = EngineMetrics("m", "0", lambda: fake_snapshot(spec=self.spec))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=self.metrics.render().decode())
        s = self.spec
        per_pos = (s.accepted_per_pos[0] + 1, s.accepted_per_pos[1] + 1, s.accepted_per_pos[2])
        self.spec = replace(
            s,
            num_drafts=s.num_drafts + 1,
            num_draft_tokens=s.num_draft_tokens + 3,
            num_accepted_tokens=s.num_accepted_tokens + 2,
            accepted_per_pos=per_pos,
        )
        n = json.loads(request.content)["max_tokens"]
        events = [{"choices": [{"index": 0, "text": "x"}]}] * n
        events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n}})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


async def test_http_run_reports_the_window_after_the_warm_up() -> None:
    server = _SpeculatingServer()

    @contextlib.asynccontextmanager
    async def open_target(mode: Mode):
        target = HttpTarget("http://fake/v1", transport=httpx.MockTransport(server))
        await target.start()
        try:
            yield target
        finally:
            await target.stop()

    reqs = build_requests(WorkloadSpec(num_prompts=5, input_len=8, output_len=4))
    result = await run_mode(Mode("ngram"), open_target, reqs, RunSettings(warmup_requests=2))
    assert result.summary.completed == 5 and result.stallfree is not None
    spec = result.stallfree.spec
    assert spec is not None  # the two warm-up requests' drafts are not counted
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (5, 15, 10)
    assert spec.acceptance_rate == pytest.approx(2 / 3)
    assert spec.mean_acceptance_length == pytest.approx(3.0)
    assert spec.acceptance_rate_per_pos == {"0": 1.0, "1": 1.0, "2": 0.0}


async def test_in_process_run_with_and_without_speculation() -> None:
    """A real engine: speculation on gives the figures (consistent with its own counters),
    off gives none."""
    from stallfree.bench.targets import InProcessTarget
    from tests.engine_util import engine_config

    reqs = build_requests(WorkloadSpec(num_prompts=3, input_len=12, output_len=8))
    rs = RunSettings(warmup_requests=0, ignore_eos=True)
    figures = {}
    for name, sections in (
        ("off", {}),
        ("ngram", {"speculative": {"method": "ngram", "num_speculative_tokens": 2}}),
    ):

        @contextlib.asynccontextmanager
        async def open_target(mode: Mode, sections: dict = sections):
            target = InProcessTarget(engine_config("tiny", **sections))
            await target.start()
            try:
                yield target
            finally:
                await target.stop()

        result = await run_mode(Mode(name), open_target, reqs, rs)
        assert result.summary.completed == 3, result.errors
        assert result.stallfree is not None
        figures[name] = result.stallfree.spec
    assert figures["off"] is None
    spec = figures["ngram"]
    assert spec is not None and spec.num_drafts is not None
    assert spec.num_accepted_tokens is not None and spec.num_draft_tokens is not None
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    if spec.num_drafts:
        assert spec.mean_acceptance_length == 1 + spec.num_accepted_tokens / spec.num_drafts
        assert spec.acceptance_rate_per_pos is not None
        assert set(spec.acceptance_rate_per_pos) == {"0", "1"}
    else:
        assert spec.acceptance_rate is None and spec.mean_acceptance_length is None
