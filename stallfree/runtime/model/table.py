"""The README's supported-models table, written from FAMILIES at run time:
`python -m stallfree.runtime.model.table [README.md]` prints it or rewrites it in place."""

from __future__ import annotations

import sys
from pathlib import Path

from stallfree.config.doc import write_between
from stallfree.runtime.model.arch import FAMILIES

START, END = "<!-- models-table:start -->", "<!-- models-table:end -->"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def models_table() -> str:
    rows = [
        "| architecture | `model_type` | implementation | safetensors "
        "| GGUF (`general.architecture`) | tensor parallel | HiSparse |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in FAMILIES.values():
        types = ", ".join(f"`{t}`" for t in f.model_types)
        gguf = ", ".join(f"`{g}`" for g in f.gguf) or "no"
        rows.append(
            f"| `{f.architecture}` | {types} | native | yes | {gguf} "
            f"| {_yes(f.tensor_parallel)} | {_yes(f.hisparse)} |"
        )
    rows.append(
        "| any other causal LM transformers builds (GPT-2, GPT-NeoX, OPT, Phi, Granite, ...) "
        "| its own | transformers fallback (`--model-impl transformers`; auto picks it) "
        "| yes | no | no | no |"
    )
    return "\n".join(rows)


def update_readme(path: Path) -> None:
    write_between(path, START, END, models_table())


if __name__ == "__main__":
    if len(sys.argv) > 1:
        update_readme(Path(sys.argv[1]))
    else:
        print(models_table())
