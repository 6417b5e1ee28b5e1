"""LoRA's rows of the flag table, in vLLM's spelling: `--enable-lora`, `--lora-modules` (each
`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`),
`--max-loras`, `--max-lora-rank` and `--max-cpu-loras`, all filling the `lora` section."""

from __future__ import annotations

import argparse
import json
from typing import Any

from stallfree.entrypoints.flags import SWITCH, Table, flag, positive_int

_JSON_KEYS = ("name", "path", "base_model_name")


def lora_module(text: str) -> dict[str, Any]:
    """One `--lora-modules` item: `name=path` or a JSON object with name and path."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} ({exc.msg})") from None
        if not isinstance(value, dict) or not {"name", "path"} <= set(value):
            raise argparse.ArgumentTypeError(f"a LoRA module needs a name and a path: {text!r}")
        unknown = sorted(set(value) - set(_JSON_KEYS))
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown LoRA module key(s) {', '.join(unknown)}; known: {', '.join(_JSON_KEYS)}"
            )
        if not all(isinstance(v, str) and v for v in value.values() if v is not None):
            raise argparse.ArgumentTypeError(f"a LoRA module's values are strings: {text!r}")
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"not name=path: {text!r}")
    return {"name": name, "path": path}


# fmt: off
LORA_FLAGS: Table = (
    ("LoRA adapters", [
        flag("--enable-lora", sets="lora.enable_lora", **SWITCH,
             help="serve LoRA adapters; a request picks one by name in its model field"),
        flag("--lora-modules", nargs="+", type=lora_module, metavar="NAME=PATH",
             sets="lora.lora_modules",
             help="adapters loaded at start: name=path, or vLLM's JSON form "
             '\'{"name": ..., "path": ..., "base_model_name": ...}\''),
        flag("--max-loras", type=positive_int, sets="lora.max_loras",
             help="adapters resident at once (the slots a batch's rows use)"),
        flag("--max-lora-rank", type=positive_int, sets="lora.max_lora_rank",
             help="the largest adapter rank served"),
        flag("--max-cpu-loras", type=positive_int, sets="lora.max_cpu_loras", unset="max-loras",
             help="adapters whose weights stay in host memory"),
    ]),
)
# fmt: on
