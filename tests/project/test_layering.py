"""The package's layers point one way: an import never reaches up, not even for type checking."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

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


# The room contracts of pyproject.toml: (contract, its container, a low room whose probe module
# imports a higher one when the probe is told to reach up, that higher room).
ROOM_CONTRACTS = [
    ("runtime rooms", "stallfree.runtime", "memory", "scheduling"),
    ("server rooms", "stallfree.entrypoints.server", "base", "api"),
]


def _rooms(container: str) -> list[str]:
    """The rooms of `container`, top to bottom, as pyproject.toml's contract lists them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (rooms,) = [c["layers"] for c in contracts if c.get("containers") == [container]]
    return rooms


def _lint_probe(
    tmp_path: Path, monkeypatch, contract: str, container: str, low: str, high: str, upward: bool
) -> int:
    """Run import-linter with a rooms contract over a probe package laid out as `container`,
    whose `high` room imports the `low` room, and whose `low` room imports the `high` one
    (under TYPE_CHECKING) when `upward`."""
    rooms = _rooms(container)
    assert rooms.index(high) < rooms.index(low), (high, low, rooms)
    name = f"rooms_probe_{container.rsplit('.', 1)[-1]}_{'up' if upward else 'down'}"
    inner = container.split(".")[1:]
    box = tmp_path / name
    box.mkdir(parents=True)
    (box / "__init__.py").write_text("")
    for part in inner:
        box = box / part
        box.mkdir()
        (box / "__init__.py").write_text("")
    dotted = ".".join([name, *inner])
    for room in rooms:
        (box / room).mkdir()
        (box / room / "__init__.py").write_text("")
    (box / high / "upper.py").write_text(f"from {dotted}.{low} import lower\n")
    lower = "from typing import TYPE_CHECKING\n"
    if upward:
        lower += f"if TYPE_CHECKING:\n    from {dotted}.{high} import upper\n"
    (box / low / "lower.py").write_text(lower)
    layers = "".join(f'    "{room}",\n' for room in rooms)
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.importlinter]\nroot_package = "{name}"\n\n'
        "[[tool.importlinter.contracts]]\n"
        f'name = "{contract}"\ntype = "layers"\n'
        f'containers = ["{dotted}"]\nlayers = [\n{layers}]\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    manager = logging.Logger.manager
    before = {
        n: lg.disabled for n, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)
    }
    try:
        return lint_imports(config_filename="pyproject.toml", no_cache=True, no_logo=True)
    finally:
        for logger_name, disabled in before.items():
            logging.getLogger(logger_name).disabled = disabled
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            sys.modules.pop(module)


@pytest.mark.parametrize(("contract", "container", "low", "high"), ROOM_CONTRACTS)
def test_a_rooms_contract_fails_on_an_upward_import_between_rooms(
    tmp_path, monkeypatch, contract, container, low, high
):
    args = (monkeypatch, contract, container, low, high)
    assert _lint_probe(tmp_path / "down", *args, upward=False) == 0
    assert _lint_probe(tmp_path / "up", *args, upward=True) == 1


@pytest.mark.parametrize("container", [c[1] for c in ROOM_CONTRACTS])
def test_a_rooms_contract_covers_every_room(container):
    rooms = _rooms(container)
    here = ROOT.joinpath(*container.split("."))
    present = {p.name for p in here.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.stem for p in here.glob("*.py") if p.stem != "__init__"}
    assert set(rooms) == present


def test_the_server_rooms_contract_is_exhaustive_like_the_runtime_one():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    by_name = {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}
    for contract, container, _, _ in ROOM_CONTRACTS:
        assert by_name[contract]["containers"] == [container]
        assert by_name[contract]["type"] == "layers"
        assert by_name[contract]["exhaustive"] is True, contract


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_a_module_that_imports_it_back():
    """Over the whole package, TYPE_CHECKING imports included (grimp reads them)."""
    assert _cycles(grimp.build_graph("stallfree")) == []


def test_the_cycle_check_finds_a_type_checking_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "cycle_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cycle_probe import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cycle_probe import a\n"
    )
    (pkg / "c.py").write_text("from cycle_probe import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cycle_probe", cache_dir=None)
    assert _cycles(graph) == [["cycle_probe.a", "cycle_probe.b"]]
    sys.modules.pop("cycle_probe", None)
