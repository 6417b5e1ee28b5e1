"""CONTRIBUTING.md says what the project is: its layer and room lists are the import-linter
contracts of pyproject.toml, its list of model families is `FAMILIES`, and the files it points
to exist. (docs/modules.md is held to the package the same way, in test_docs_modules.py.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from stallfree.runtime.model.arch import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
CONTRIBUTING = ROOT / "CONTRIBUTING.md"

# `- layers of `stallfree` ("stallfree layers"): `a`, `b` | `c`, ...` (continued on indented lines)
STACK = re.compile(r'^- (?:layers|rooms) of `([\w.]+)` \("([^"]+)"\): (.*)$')


def contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}


def stacks(text: str) -> dict[str, tuple[str, list[tuple[str, ...]]]]:
    """contract name -> (container, its layers top to bottom, peers grouped) as written."""
    bullets: list[str] = []
    for line in text.splitlines():
        if line.startswith("- "):
            bullets.append(line)
        elif bullets and line.startswith("  ") and line.strip():
            bullets[-1] += " " + line.strip()
        else:
            bullets.append("")
    found = {}
    for bullet in bullets:
        if m := STACK.match(bullet):
            container, name, names = m.groups()
            layers = [
                tuple(part.strip().strip("`") for part in entry.split("|"))
                for entry in names.rstrip(".").split(", ")
            ]
            found[name] = (container, layers)
    return found


def test_every_contract_is_listed_as_pyproject_declares_it():
    written = stacks(CONTRIBUTING.read_text())
    declared = contracts()
    assert sorted(written) == sorted(declared), (
        f"CONTRIBUTING.md lists the stacks {sorted(written)}; pyproject.toml's contracts are "
        f"{sorted(declared)}"
    )
    for name, contract in declared.items():
        container, layers = written[name]
        assert [container] == contract["containers"], name
        expected = [tuple(entry.split(" | ")) for entry in contract["layers"]]  # type: ignore[attr-defined]
        assert layers == expected, (
            f"CONTRIBUTING.md lists {name!r} as {layers}; pyproject.toml says {expected}"
        )


def test_the_check_reads_a_stack_with_peers_and_continuation_lines():
    text = 'intro\n- layers of `pkg` ("pkg layers"): `top`, `a` | `b`,\n  `bottom`\nnot a bullet\n'
    assert stacks(text) == {"pkg layers": ("pkg", [("top",), ("a", "b"), ("bottom",)])}


def test_the_model_families_named_are_those_of_FAMILIES():
    text = CONTRIBUTING.read_text()
    section = text[text.index("## Adding a model architecture") :]
    named = set(re.findall(r"`(\w+ForCausalLM)`", section))
    assert named == set(FAMILIES), (
        f"CONTRIBUTING.md's model section names {sorted(named - set(FAMILIES))} that FAMILIES "
        f"lacks and misses {sorted(set(FAMILIES) - named)}"
    )


def test_every_file_named_exists():
    """A backticked `.py` path is relative to `stallfree/` (`runtime/model/arch.py`) or to the
    repository (`tests/hf_models.py`, `stallfree/...`)."""
    paths = set(re.findall(r"`([\w./]+\.py)`", CONTRIBUTING.read_text()))
    missing = sorted(
        p
        for p in paths
        if "/" in p and not (ROOT / p).exists() and not (ROOT / "stallfree" / p).exists()
    )
    assert not missing, f"CONTRIBUTING.md names files that do not exist: {missing}"
