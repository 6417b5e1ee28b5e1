"""How an embedder turns hidden states into one vector per input: pooling, normalisation and
Matryoshka truncation, as the checkpoint's sentence-transformers files say.

The files read: `modules.json` (is there a `Normalize` module), the pooling module's
`config.json` (`1_Pooling/config.json`: which pooling), `sentence_bert_config.json`
(`max_seq_length`), and the model's `config.json` (`is_matryoshka` or `matryoshka_dimensions`:
may the vector be cut short). A checkpoint without `modules.json` gets the runner's defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.request.errors import InvalidRequestError

PoolingMode = Literal["mean", "cls", "last", "max", "mean_sqrt_len"]
POOLING_MODES: tuple[PoolingMode, ...] = ("mean", "cls", "last", "max", "mean_sqrt_len")

# sentence-transformers' pooling flags, in the order it reads them
_ST_FLAGS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last",
}


class Embedder(Protocol):
    """What the pooling runner runs: hidden states for a batch of token-id rows."""

    hidden_size: int
    vocab_size: int
    max_positions: int

    def hidden_states(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T, hidden] float, mask [B, T] True on real tokens, padding on the right)."""
        ...


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool
    dimension: int  # the pooled vector's length
    matryoshka: bool  # whether `dimensions` may cut it short
    max_seq_length: int | None  # sentence-transformers' limit on an input, if it set one


def with_override(cfg: PoolingConfig, override: dict[str, Any] | None) -> PoolingConfig:
    """`cfg` with vLLM's `--override-pooler-config` applied (checked by the config)."""
    if not override:
        return cfg
    mode = override.get("pooling_type")
    return replace(
        cfg,
        mode=_MODES[mode] if mode is not None else cfg.mode,
        normalize=override.get("normalize", cfg.normalize),
    )


_MODES: dict[str, PoolingMode] = {mode.upper(): mode for mode in POOLING_MODES}


def read_pooling_config(
    path: Path,
    model_config: dict[str, Any],
    hidden_size: int,
    default_mode: PoolingMode,
    default_normalize: bool = False,
) -> PoolingConfig:
    """The checkpoint's pooling; without a `modules.json`, `default_mode` and
    `default_normalize`."""
    modules = _read(path / "modules.json", None)
    mode: PoolingMode = default_mode
    normalize = default_normalize if modules is None else False
    dimension = hidden_size
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            pooling = _read(path / str(module.get("path", "")) / "config.json", {})
            mode = _st_mode(pooling, default_mode)
            dimension = int(pooling.get("word_embedding_dimension", hidden_size))
        elif kind.endswith(".Dense"):
            raise ModelLoadError("sentence-transformers Dense modules are not supported")
    if dimension != hidden_size:
        raise ModelLoadError(
            f"the pooling module's dimension {dimension} is not the hidden size {hidden_size}"
        )
    st_config = _read(path / "sentence_bert_config.json", {})
    max_seq = st_config.get("max_seq_length") if isinstance(st_config, dict) else None
    matryoshka = bool(
        model_config.get("is_matryoshka") or model_config.get("matryoshka_dimensions")
    )
    return PoolingConfig(
        mode=mode,
        normalize=normalize,
        dimension=dimension,
        matryoshka=matryoshka,
        max_seq_length=int(max_seq) if isinstance(max_seq, int) and max_seq > 0 else None,
    )


def _st_mode(pooling: Any, default: PoolingMode) -> PoolingMode:
    if not isinstance(pooling, dict):
        return default
    chosen = [mode for flag, mode in _ST_FLAGS.items() if pooling.get(flag)]
    if len(chosen) > 1:
        raise ModelLoadError(f"several pooling modes at once are not supported: {chosen}")
    if pooling.get("pooling_mode_weightedmean_tokens"):
        raise ModelLoadError("weighted-mean pooling is not supported")
    return chosen[0] if chosen else default


def _read(path: Path, default: Any) -> Any:
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """hidden [B, T, H] and mask [B, T] (True on real tokens, padded on the right) -> [B, H]."""
    weights = mask.to(hidden.dtype)[..., None]
    lengths = weights.sum(dim=1).clamp(min=1.0)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if mode == "max":
        return hidden.masked_fill(~mask[..., None], float("-inf")).amax(dim=1)
    summed = (hidden * weights).sum(dim=1)
    if mode == "mean_sqrt_len":
        return summed / lengths.sqrt()
    return summed / lengths


def finish(pooled: torch.Tensor, cfg: PoolingConfig, dimensions: int | None) -> torch.Tensor:
    """Normalise as the checkpoint says; with `dimensions`, keep the first ones and normalise
    again (a Matryoshka vector cut short is still a unit vector when the model's is)."""
    out = pooled.float()
    if cfg.normalize:
        out = F.normalize(out, p=2.0, dim=-1)
    if dimensions is not None and dimensions < out.shape[-1]:
        out = out[:, :dimensions]
        if cfg.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
    return out


def check_dimensions(cfg: PoolingConfig, dimensions: int | None) -> None:
    """A request's `dimensions`: a positive count up to the model's, below it only for a
    Matryoshka model; anything else is the request's error (a 400)."""
    if dimensions is None:
        return
    full = cfg.dimension
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise InvalidRequestError("dimensions must be a positive integer", param="dimensions")
    if dimensions > full:
        raise InvalidRequestError(
            f"dimensions {dimensions} is more than the model's {full}", param="dimensions"
        )
    if dimensions < full and not cfg.matryoshka:
        raise InvalidRequestError(
            f"this model's embeddings cannot be shortened (it is not a Matryoshka "
            f"model); dimensions must be {full} or left out",
            param="dimensions",
        )
