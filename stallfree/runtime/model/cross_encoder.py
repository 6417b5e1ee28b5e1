"""A BERT cross-encoder (`BertForSequenceClassification`): a pair of texts read as one input
(segment A, then B), the [CLS] state through BERT's pooler (dense, tanh) and a linear head to
the labels' logits. The pooling runner's scorer for `/v1/score` and `/v1/rerank`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.model.bert import BertConfig, BertEncoder, load_weights

CROSS_ENCODER_ARCHITECTURES = frozenset({"BertForSequenceClassification"})


class _Pooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class _Bert(BertEncoder):
    """The encoder with the [CLS] pooler a classification checkpoint stores beside it."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__(cfg)
        self.pooler = _Pooler(cfg.hidden_size)


class BertCrossEncoder(nn.Module):
    def __init__(self, cfg: BertConfig, num_labels: int) -> None:
        super().__init__()
        self.bert = _Bert(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        self.num_labels = num_labels
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_position_embeddings

    @torch.inference_mode()
    def logits(self, rows: list[list[int]], second: list[int]) -> torch.Tensor:
        """[B, num_labels] float; `second[i]` is where row i's segment B starts (its length
        when it has none). The rows run packed, without padding (`BertEncoder.packed`)."""
        device = self.classifier.weight.device
        types = [[0] * s + [1] * (len(r) - s) for r, s in zip(rows, second, strict=True)]
        hidden = self.bert.packed(rows, types)
        lengths = torch.tensor([len(r) for r in rows], device=device)
        first = hidden[lengths.cumsum(0) - lengths]  # each row's first token: its [CLS] state
        out: torch.Tensor = self.classifier(self.bert.pooler(first))
        return out.float()


def load_cross_encoder(
    path: Path, cfg: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> BertCrossEncoder:
    # transformers stores the label count as id2label's size (2 when it has none)
    labels = cfg.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else int(cfg.get("num_labels", 2))
    if num_labels < 1:
        raise ModelLoadError(f"num_labels {num_labels} is not a positive count")
    with torch.device("meta"):
        model = BertCrossEncoder(BertConfig.from_dict(cfg), num_labels)

    def rename(key: str) -> str | None:
        return None if key.endswith("position_ids") else key

    return load_weights(model, path, dtype, device, rename).eval()
