"""docs/modules.md lists every module of the package, and names none that does not exist.

Which files count: every `.py` file under `stallfree/`, `__init__.py` and `__main__.py`
included (a package's `__init__` holds its public names and docstring, so it gets a line too).
A module is listed when it is the first cell of a table row of docs/modules.md, written as its
path in backticks (`| `stallfree/x/y.py` | what it holds |`). Each row must sit under the
heading of its layer (the first package under `stallfree/`) or, inside `stallfree/runtime/` and
`stallfree/entrypoints/server/`, of its room; the headings must follow the three import-linter
layers contracts of pyproject.toml, top to bottom. The architecture page's two room tables must
list the rooms of the "runtime rooms" and "server rooms" contracts in the contracts' order.

Adding a module (or a room) means adding its line to docs/modules.md: this test says which.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "stallfree"
MODULES_MD = ROOT / "docs" / "modules.md"
ARCHITECTURE_MD = ROOT / "docs" / "architecture.md"

ROW = re.compile(r"^\|\s*`(stallfree/[^`]*)`\s*\|(.*)\|\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
PATH = re.compile(r"`(stallfree/[A-Za-z0-9_./]*)`")


def package_modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")}


def doc_rows(text: str) -> list[tuple[str, str, str]]:
    """(path, description, the nearest heading above it) for every module row."""
    rows = []
    heading = ""
    for line in text.splitlines():
        if m := HEADING.match(line):
            heading = m.group(2)
        elif m := ROW.match(line):
            rows.append((m.group(1), m.group(2).strip(), heading))
    return rows


def headings(text: str) -> list[str]:
    return [m.group(2) for line in text.splitlines() if (m := HEADING.match(line))]


def heading_keys(heading: str) -> set[str]:
    """The names a heading's backticked paths stand for: `stallfree/runtime/` -> runtime,
    `core.py` -> core, `scheduling/` -> scheduling, `stallfree/` -> stallfree."""
    keys = set()
    for token in re.findall(r"`([^`]+)`", heading):
        name = token.rstrip("/").split("/")[-1]
        keys.add(name.removesuffix(".py"))
    return keys


def group_of(path: str) -> str:
    """The layer (or, inside the runtime, the room) a module belongs to."""
    parts = path.split("/")
    assert parts[0] == "stallfree", path
    if len(parts) == 2:
        name = parts[1].removesuffix(".py")
        return "stallfree" if name == "__init__" else name
    if parts[1] == "runtime":
        if len(parts) == 3:
            name = parts[2].removesuffix(".py")
            return "runtime" if name == "__init__" else name
        return parts[2]
    if parts[1:3] == ["entrypoints", "server"]:
        if len(parts) == 4:
            name = parts[3].removesuffix(".py")
            return "server" if name == "__init__" else name
        return parts[3]
    return parts[1]


def contract_layers(name: str) -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["name"] == name:
            return [layer for entry in contract["layers"] for layer in entry.split(" | ")]
    raise AssertionError(f"pyproject.toml has no import-linter contract named {name!r}")


def test_every_module_has_a_row():
    listed = {path for path, _, _ in doc_rows(MODULES_MD.read_text())}
    missing = sorted(package_modules() - listed)
    assert not missing, (
        "docs/modules.md has no row for these modules; add one line each, under the heading "
        f"of its layer or room: {missing}"
    )


def test_every_path_named_exists():
    text = MODULES_MD.read_text()
    stale = sorted({p for p in PATH.findall(text) if not (ROOT / p).exists()})
    assert not stale, f"docs/modules.md names paths that do not exist: {stale}"
    rows = [path for path, _, _ in doc_rows(text)]
    not_modules = sorted(p for p in rows if not p.endswith(".py"))
    assert not not_modules, f"docs/modules.md rows that are not modules: {not_modules}"


def test_one_row_per_module_each_with_a_description():
    rows = doc_rows(MODULES_MD.read_text())
    paths = [path for path, _, _ in rows]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    assert not twice, f"docs/modules.md lists these modules more than once: {twice}"
    empty = [path for path, desc, _ in rows if not desc]
    assert not empty, f"docs/modules.md rows without a description: {empty}"


def test_each_row_sits_under_its_layer_or_room():
    misplaced = [
        (path, heading)
        for path, _, heading in doc_rows(MODULES_MD.read_text())
        if group_of(path) not in heading_keys(heading)
    ]
    assert not misplaced, (
        f"docs/modules.md rows under another layer's or room's heading (path, heading): {misplaced}"
    )


def _in_contract_order(contract: str) -> None:
    """Each layer of `contract` has a heading, and their first headings come in its order."""
    keys = [heading_keys(h) for h in headings(MODULES_MD.read_text())]
    first: dict[str, int] = {}
    for layer in contract_layers(contract):
        found = [i for i, k in enumerate(keys) if layer in k]
        assert found, f"docs/modules.md has no heading for {layer!r} of the {contract!r} contract"
        first[layer] = found[0]
    shown = sorted(first, key=first.__getitem__)
    assert list(first.values()) == sorted(first.values()), (
        f"docs/modules.md lists the {contract!r} contract's layers as {shown}; the contract "
        f"says {list(first)}"
    )


def test_layer_headings_follow_the_layers_contract():
    _in_contract_order("stallfree layers")


def test_room_headings_follow_the_rooms_contract():
    _in_contract_order("runtime rooms")


def test_server_room_headings_follow_the_server_rooms_contract():
    _in_contract_order("server rooms")


def _architecture_room_tables() -> list[list[str]]:
    """The rooms listed by each table of docs/architecture.md whose first column is `room`."""
    text = ARCHITECTURE_MD.read_text()
    tables = []
    for table in re.finditer(r"^\| room \|.*?\n((?:\|.*\n)+)", text, re.M):
        rooms = []
        for line in table.group(1).splitlines()[1:]:  # the first line is the |---| separator
            first = line.split("|")[1]
            rooms.extend(sorted(heading_keys(first)))
        tables.append(rooms)
    return tables


def test_architecture_room_tables_follow_the_rooms_contracts():
    tables = _architecture_room_tables()
    assert len(tables) == 2, (
        "docs/architecture.md should have two room tables (first column `room`): the runtime's "
        f"and the server's; it has {len(tables)}"
    )
    for rooms, contract in zip(tables, ("runtime rooms", "server rooms"), strict=True):
        assert rooms == contract_layers(contract), (
            f"docs/architecture.md's room table lists {rooms}; the {contract} contract says "
            f"{contract_layers(contract)}"
        )


def test_the_docs_name_no_missing_stallfree_path():
    docs = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    docs += [p for p in (ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md") if p.exists()]
    stale = sorted(
        (doc.relative_to(ROOT).as_posix(), p)
        for doc in docs
        for p in set(PATH.findall(doc.read_text()))
        if not (ROOT / p).exists()
    )
    assert not stale, f"(document, path) pairs naming a stallfree path that does not exist: {stale}"
