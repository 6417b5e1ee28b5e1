"""What a pooling request answers (`Pooled`), and how an aborted one ends, for both pooling
runners (`pooler.py`'s encoder loop, and `embed_requests.py`'s scheduled decoder embedder on
the pooling runner or beside generation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PoolingAborted(RuntimeError):
    """The request was aborted (`abort`) before its answer."""


@dataclass(frozen=True, slots=True)
class Pooled:
    """One request's outputs, float32 on the host: its vectors ([inputs, dimensions]) from an
    embedder, its scores ([inputs]) from a cross-encoder; and its token count."""

    outputs: torch.Tensor
    prompt_tokens: int
