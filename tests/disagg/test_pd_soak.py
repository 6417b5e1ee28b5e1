"""A bounded PD soak (issue 42): 100 streaming requests at once through the router to a prefill
and a decode server (real processes, `benchmarks/pd_soak.py`): none fails, none is lost on a
pooled connection (and resent), none goes without progress for the configured stall deadline,
and both pools are free after. The 1,000-request run is the script's default
(docs/disaggregation.md has its figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocess servers (see pyproject)

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 120.0


def test_a_hundred_concurrent_pd_requests_all_finish(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--requests", "100", "--stall-timeout", str(STALL_S), "--json", str(out)]
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "pd_soak.py"),
            *args,
            "--log-dir",
            str(tmp_path),
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(out.read_text())
    print(json.dumps(figures, indent=1))  # shown when an assertion fails
    assert figures["requests"] == 100
    assert figures["failed"] == 0, figures["first_errors"]
    # no request was lost on a pooled connection the router closed (the client resends those)
    assert figures["resent"] == 0
    assert figures["gaps_at_deadline"] == 0  # no request went STALL_S without an event
    assert figures["left_running"] == {"prefill": 0.0, "decode": 0.0}
    assert done.returncode == 0
