"""The package's layers point one way: an import never reaches up, not even for type checking."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]
# top to bottom, as in pyproject.toml's import-linter contract
LAYERS = [
    ("__main__",),
    ("cli",),
    ("bench",),
    ("entrypoints",),
    ("hisparse", "metrics"),
    ("runtime",),
    ("overlap",),
    ("config",),
]


def _rank(module: str, package: str = "stallfree") -> tuple[int, str] | None:
    parts = module.split(".")
    if parts[0] != package or len(parts) < 2:
        return None
    for rank, names in enumerate(LAYERS):
        if parts[1] in names:
            return rank, parts[1]
    return None


def upward_imports(graph: grimp.ImportGraph, package: str = "stallfree") -> list[str]:
    """Every import whose importer sits in a lower layer than what it imports, or that joins
    two sibling plug-ins."""
    bad = []
    for importer in sorted(graph.modules):
        here = _rank(importer, package)
        if here is None:
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            there = _rank(imported, package)
            if there is None or there[1] == here[1]:
                continue
            if there[0] <= here[0]:
                bad.append(f"{importer} -> {imported}")
    return bad


def test_import_linter_contract_is_kept(monkeypatch):
    import stallfree.runtime.scheduling.loop  # noqa: F401  (its logger exists before the lint runs)

    monkeypatch.chdir(ROOT)
    manager = logging.Logger.manager
    before = {
        n: lg.disabled for n, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)
    }
    try:
        assert lint_imports(no_cache=True, no_logo=True) == 0
    finally:
        # NOTE: import-linter configures logging with disable_existing_loggers, which silenced
        # every stallfree logger for the tests after this one (their caplog saw nothing)
        for name, disabled in before.items():
            logging.getLogger(name).disabled = disabled
    assert not logging.getLogger("stallfree.runtime.scheduling.loop").disabled


def test_no_import_points_up_and_no_subpackage_cycle():
    graph = grimp.build_graph("stallfree")
    assert upward_imports(graph) == []


def test_the_check_sees_type_checking_imports(tmp_path, monkeypatch):
    """A lower layer that imports a higher one only for type hints still breaks the rule."""
    pkg = tmp_path / "layered_probe"
    for sub in ("runtime", "metrics"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "metrics" / "collector.py").write_text("from layered_probe.runtime import core\n")
    (pkg / "runtime" / "core.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from layered_probe.metrics.collector import Collector\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("layered_probe", cache_dir=None)
    assert upward_imports(graph, "layered_probe") == [
        "layered_probe.runtime.core -> layered_probe.metrics.collector"
    ]
    sys.modules.pop("layered_probe", None)


@pytest.mark.parametrize("layer", ["config", "overlap", "runtime"])
def test_importing_a_lower_layer_loads_nothing_above_it(layer):
    """Checked in a fresh interpreter: what a layer pulls in at import time stays below it."""
    code = (
        f"import sys, stallfree.{layer}\n"
        "order = ['config', 'overlap', 'runtime']\n"
        f"allowed = set(order[: order.index('{layer}') + 1])\n"
        "loaded = {m.split('.')[1] for m in sys.modules if m.startswith('stallfree.')}\n"
        "print(sorted(loaded - allowed))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_python_dash_m_and_version():
    from stallfree import __version__

    out = subprocess.run(
        [sys.executable, "-m", "stallfree", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"stallfree {__version__}"
