"""Where a model named in the config is kept: a path stays a path; a Hugging Face Hub id
(`org/name`) is resolved through `huggingface_hub` to its snapshot in the local cache,
downloaded first when the network allows; `org/name:file.gguf` (or `org/name:Q8_0`, a
quantization tag, as llama.cpp's `-hf` takes it) picks one GGUF file of the repo.

`HF_HOME`, `HF_HUB_CACHE` and `HF_HUB_OFFLINE` are read when a model is resolved, not when
`huggingface_hub` was first imported. Errors name the id and the reason, never a path of this
machine's disk."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stallfree.config.settings import StallfreeConfig

# `org/name`, optionally `:file.gguf` or `:TAG`; Hub names are letters, digits, `-`, `_`, `.`
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<pick>[\w.-]+))?")
# the files of a repo a model directory needs (weights, configs, tokenizer, template, code)
_DIRECTORY_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"]
_TRUE = ("1", "true", "yes", "on")


class ModelSourceError(ValueError):
    """A model that is neither a local path nor a Hub id this machine can get."""


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """`(repo, pick)` when `spec` reads as a Hub id and is not a local path, else None."""
    if Path(spec).exists() or spec.startswith((".", "/", "~")):
        return None
    match = _HUB_ID.fullmatch(spec)
    if match is None or match["repo"].endswith((".", "-")) or ".." in match["repo"]:
        return None
    return match["repo"], match["pick"]


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache() -> str:
    """The Hub cache this process uses now: HF_HUB_CACHE, else HF_HOME/hub, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    return os.path.join(home, "hub")


def resolve_model(spec: str, what: str = "model") -> str:
    """The local path `spec` names: itself unless it is a Hub id, else the id's snapshot
    directory (or GGUF file) in the Hub cache. ModelSourceError says why it cannot be had."""
    parsed = hub_id(spec)
    if parsed is None:
        return spec
    repo, pick = parsed
    hub = _import_hub(what, spec)
    where = {"cache_dir": hub_cache(), "local_files_only": offline()}
    try:
        if pick is None:
            return str(hub.snapshot_download(repo, allow_patterns=_DIRECTORY_FILES, **where))
        name = pick if pick.lower().endswith(".gguf") else _gguf_named(hub, repo, pick, where)
        return str(hub.hf_hub_download(repo, name, **where))
    except ModelSourceError:
        raise
    except Exception as exc:  # huggingface_hub's errors name cache paths: say why, not where
        raise ModelSourceError(_reason(what, spec, exc)) from None


def _gguf_named(hub: Any, repo: str, tag: str, where: dict[str, Any]) -> str:
    """The repo's one .gguf file whose name holds `tag` (any case), as llama.cpp picks it."""
    if where["local_files_only"]:
        folder = Path(hub.snapshot_download(repo, allow_patterns=["*.gguf"], **where))
        files = [str(p.relative_to(folder)) for p in folder.rglob("*.gguf")]
    else:
        files = [f for f in hub.list_repo_files(repo) if f.endswith(".gguf")]
    found = sorted(f for f in files if tag.lower() in Path(f).name.lower())
    if len(found) != 1:
        have = ", ".join(sorted(files)) or "none"
        which = "no" if not found else "more than one"
        raise ModelSourceError(
            f"{repo}:{tag}: {which} .gguf file of the repo matches {tag!r} (its .gguf files: "
            f"{have}); name the file, as {repo}:FILE.gguf"
        )
    return found[0]


def _reason(what: str, spec: str, exc: Exception) -> str:
    kind = type(exc).__name__
    if kind in ("RepositoryNotFoundError", "RevisionNotFoundError"):
        why = "no such repository on the Hugging Face Hub (or it is private and no token is set)"
    elif kind == "GatedRepoError":
        why = "the repository is gated: accept its terms on the Hub and set HF_TOKEN"
    elif kind in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
        why = "the repository has no such file"
    elif offline():
        why = "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
    else:
        why = "not in the local Hugging Face cache, and the Hub could not be reached"
    return (
        f"{what} {spec!r} is not a local path, and as a Hugging Face Hub id it cannot be had: {why}"
    )


def _import_hub(what: str, spec: str) -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise ModelSourceError(
            f"{what} {spec!r} is not a local path; a Hugging Face Hub id needs huggingface_hub "
            "(pip install huggingface_hub)"
        ) from None
    return huggingface_hub


def resolve_model_source(config: StallfreeConfig) -> StallfreeConfig:
    """`config` with its model, tokenizer and draft model resolved to local paths (a Hub id
    given as the model is also the served model name unless one is set), and the model's
    format checked against `model.load_format`."""
    model, spec = config.model, config.speculative
    path = resolve_model(model.path)
    check_load_format(path, model.load_format)
    tokenizer = None if model.tokenizer is None else resolve_model(model.tokenizer, "tokenizer")
    draft = None if spec.draft_model is None else resolve_model(spec.draft_model, "draft model")
    update: dict[str, Any] = {
        "model": model.model_copy(update={"path": path, "tokenizer": tokenizer}),
        "speculative": spec.model_copy(update={"draft_model": draft}),
    }
    if path != model.path and config.server.served_model_name is None:
        update["server"] = config.server.model_copy(update={"served_model_name": model.path})
    return config.model_copy(update=update)


def check_load_format(path: str, load_format: str) -> None:
    """ModelSourceError when the model at `path` is not in the format `load_format` names (a
    path that does not exist is left to the loader, which says so)."""
    local = Path(path)
    if load_format == "auto" or not local.exists():
        return
    is_gguf = local.is_file() and local.name.lower().endswith(".gguf")
    if load_format == "gguf" and not is_gguf:
        raise ModelSourceError(
            "model.load_format=gguf, but the model is not a .gguf file; name the file (for a "
            "Hub repo's GGUF: org/name:FILE.gguf or org/name:QUANT)"
        )
    if load_format == "safetensors" and is_gguf:
        raise ModelSourceError(
            "model.load_format=safetensors, but the model is a .gguf file; give a directory "
            "of safetensors, or --load-format gguf"
        )
