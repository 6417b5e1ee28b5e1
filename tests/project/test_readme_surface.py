"""The README's list of endpoints is the app's routes, and its install table is pyproject.toml's
dependencies and extras, package by package (as test_config.py holds its configuration table to
the settings)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import pytest
from fastapi.routing import APIRoute

from stallfree import Engine, load_config
from stallfree.entrypoints.server import create_app
from stallfree.entrypoints.server.api.disagg import disagg_routes

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ENDPOINT = re.compile(r"`(GET|POST|PUT|DELETE) (/[^`\s]*)`")
SELF_EXTRA = re.compile(r"^stallfree\[([\w,]+)\]$")


def paragraph(text: str, opening: str) -> str:
    """The paragraph of `text` that starts with `opening`."""
    at = text.index(opening)
    end = text.find("\n\n", at)
    return text[at : len(text) if end < 0 else end]


def _shape(path: str) -> str:
    """A route's path with its parameters unnamed (`/v1/models/{model_id:path}` ->
    `/v1/models/{}`), as the README may name them its own way."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def readme_endpoints() -> set[tuple[str, str]]:
    listed = ENDPOINT.findall(paragraph(README.read_text(), "Endpoints:"))
    return {(method, _shape(path)) for method, path in listed}


def routes_of(routes: list[Any], prefix: str = "") -> set[tuple[str, str]]:
    """(method, path) of every route, through included routers."""
    found = set()
    for route in routes:
        if isinstance(route, APIRoute):
            path = _shape(prefix + route.path)
            found |= {(m, path) for m in route.methods if m != "HEAD"}
        elif hasattr(route, "original_router"):  # an included router (FastAPI >= 0.120)
            context = getattr(route, "include_context", None)
            inner = prefix + (getattr(context, "prefix", "") or "")
            found |= routes_of(route.original_router.routes, inner)
    return found


@pytest.fixture(scope="module")
def app_routes() -> set[tuple[str, str]]:
    engine = Engine(load_config(model={"path": "tiny"}, runtime={"device": "cpu"}))
    return routes_of(create_app(engine).routes)


def test_the_readme_lists_every_route_and_no_other(app_routes):
    listed = readme_endpoints()
    role = routes_of(disagg_routes().routes)  # a disaggregated server's own route
    assert listed - role == app_routes, (
        f"README lists {sorted(listed - role - app_routes)} that the app lacks and misses "
        f"{sorted(app_routes - listed)}"
    )
    assert role <= listed, f"README misses the disaggregated role's {sorted(role - listed)}"


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (`prometheus_client` = `prometheus-client`)."""
    bare = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
    return bare.lower().replace("_", "-")


def _install_rows() -> dict[str, str]:
    """The install table: what the first column names (`base`, or an extra) -> its last."""
    text = README.read_text()
    table = re.search(r"^\| install \| for \| adds \|\n\|[- |]+\|\n((?:\|.*\n)+)", text, re.M)
    assert table, "the README lost its install table (columns install, for, adds)"
    rows = {}
    for line in table.group(1).splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`\[([\w-]+)\]`", cells[0])
        for name in names or ["base"]:
            rows[name] = cells[-1]
    return rows


def _mentions(cell: str, name: str) -> bool:
    normal = cell.lower().replace("_", "-")
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", normal) is not None


def test_the_install_table_names_every_extra_and_its_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    rows = _install_rows()
    extras = project["optional-dependencies"]
    assert set(rows) == {"base", *extras}, (
        f"the install table's rows {sorted(rows)}; pyproject.toml: base and {sorted(extras)}"
    )
    wanted = {"base": project["dependencies"], **extras}
    missing = []
    for row, requirements in wanted.items():
        for requirement in requirements:
            if m := SELF_EXTRA.match(requirement):  # another extra: named as `[x]`
                missing += [
                    (row, f"[{x}]") for x in m.group(1).split(",") if f"`[{x}]`" not in rows[row]
                ]
            elif not _mentions(rows[row], _name(requirement)):
                missing.append((row, _name(requirement)))
    assert not missing, f"install table rows that do not name a package they add: {missing}"


def test_the_checks_see_a_missing_package():
    assert _mentions("fastapi, uvicorn, prometheus_client", "prometheus-client")
    assert not _mentions("fastapi, uvicorn-extra", "uvicorn")
    assert _name("tomli>=2.0; python_version < '3.11'") == "tomli"
    assert _name("stallfree[server]") == "stallfree"
