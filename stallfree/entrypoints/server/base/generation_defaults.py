"""The model's own sampling defaults, from its `generation_config.json` (vLLM's
`--generation-config auto`, its default; `vllm` ignores the file; a directory reads that one).

A field the request leaves unset takes the model's value: `temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty`. The file's `eos_token_id`s that the tokenizer does not already
end on become extra stop token ids (unless the request sets `ignore_eos`), as vLLM adds them.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("stallfree.server")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    sampling: dict[str, float | int] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()

    def value(self, key: str, given: Any, builtin: Any) -> Any:
        """The request's value if it sent one, else the model's, else the built-in default."""
        if given is not None:
            return given
        return self.sampling.get(key, builtin)


def load_generation_defaults(
    setting: str, model_path: str, tokenizer_eos: list[int]
) -> GenerationDefaults:
    """The defaults `setting` names ("auto": the model directory's file, "vllm": none, or a
    directory holding a `generation_config.json`), and one log line saying what they are."""
    if setting == "vllm":
        return GenerationDefaults()
    folder = Path(model_path if setting == "auto" else setting)
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"server.generation_config: no generation_config.json in {folder}")
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"server.generation_config: {path} is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"server.generation_config: {path} is not a JSON object")
    sampling: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value):
            continue
        if key == "top_k":
            sampling[key] = int(value) if value >= 1 else -1  # 0 in transformers: off
        else:
            sampling[key] = float(value)
    eos = raw.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    known = set(tokenizer_eos)
    extra = tuple(
        i for i in dict.fromkeys(eos_ids) if isinstance(i, int) and i >= 0 and i not in known
    )
    from pydantic import ValidationError

    from stallfree.runtime.request.sampling_params import SamplingParams

    try:
        SamplingParams(**sampling)
    except ValidationError as exc:
        raise ValueError(
            f"server.generation_config: {path} holds sampling defaults this server cannot use "
            f"({exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}); pass "
            "--generation-config vllm to ignore the file"
        ) from None
    defaults = GenerationDefaults(sampling, extra)
    if sampling or extra:
        shown = ", ".join(f"{k}={v:g}" for k, v in sampling.items())
        if extra:
            shown += (", " if shown else "") + f"extra stop token ids {list(extra)}"
        logger.info(
            "sampling defaults from the model's %s: %s (for fields a request leaves unset; "
            "--generation-config vllm ignores the file)",
            path,
            shown,
        )
    return defaults
