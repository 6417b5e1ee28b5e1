"""The README's configuration table: `python -m stallfree.config.doc [README.md]` rewrites it."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

from stallfree.config.settings import StallfreeConfig


def config_table() -> str:
    rows = [
        "| setting | default | environment | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for section, field in StallfreeConfig.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for name, info in model.model_fields.items():
            default = info.get_default(call_default_factory=True)
            env = f"STALLFREE_{section.upper()}__{name.upper()}"
            rows.append(
                f"| `{section}.{name}` | `{default!r}` | `{env}` | {info.description or ''} |"
            )
    return "\n".join(rows)


START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def write_between(path: Path, start: str, end: str, body: str) -> None:
    """Replace what `path` holds between the marker lines `start` and `end` with `body`."""
    text = path.read_text()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{body}\n{end}{tail}")


def update_readme(path: Path) -> None:
    write_between(path, START, END, config_table())


if __name__ == "__main__":
    if len(sys.argv) > 1:
        update_readme(Path(sys.argv[1]))
    else:
        print(config_table())
