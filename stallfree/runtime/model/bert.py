"""An encoder-only BERT (`BertModel`): every token attends to every other token of its input.

The embedder's forward for the pooling runner. A batch is padded to its longest input; the
padding is masked out of attention as keys, and the pooler masks it out of the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.runtime.model.arch import ModelLoadError

ENCODER_ARCHITECTURES = frozenset({"BertModel"})

# the prefix a task head's checkpoint (`BertForSequenceClassification`, ...) puts on the encoder
_PREFIX = "bert."
# tensors an embedder does not use: the buffer of position ids, the [CLS] pooler head
_UNUSED = ("embeddings.position_ids", "pooler.")


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> BertConfig:
        try:
            config = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=int(cfg["num_attention_heads"]),
                intermediate_size=int(cfg["intermediate_size"]),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
                type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                hidden_act=str(cfg.get("hidden_act", "gelu")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is not a BERT config: {exc!r}") from exc
        if config.hidden_size % config.num_heads:
            raise ModelLoadError(
                f"hidden_size {config.hidden_size} is not a multiple of "
                f"num_attention_heads {config.num_heads}"
            )
        if config.hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {config.hidden_act!r} is not supported")
        position_type = cfg.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ModelLoadError(f"position_embedding_type {position_type!r} is not supported")
        return config


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
}


class _Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """`input_ids` [N]: the inputs one after another, `positions` each token's place in
        its own input."""
        x = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(positions)
        )
        out: torch.Tensor = self.LayerNorm(x)
        return out


class _SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """`x` [N, hidden]: the inputs one after another, `lengths` long; each attends over
        its own tokens only, so no token is padding."""
        total, hidden = x.shape
        head_dim = hidden // self.num_heads
        # [N, heads, head_dim] views: an input's rows are a slice of the token axis
        q, k, v = (
            t.view(total, self.num_heads, head_dim)
            for t in (self.query(x), self.key(x), self.value(x))
        )
        outs = []
        start = 0
        for length in lengths:
            end = start + length
            # [1, heads, L, head_dim] views in, [L, heads, head_dim] views out: the one copy
            # is the concatenation
            outs.append(
                F.scaled_dot_product_attention(
                    q[None, start:end].transpose(1, 2),
                    k[None, start:end].transpose(1, 2),
                    v[None, start:end].transpose(1, 2),
                    scale=1.0 / math.sqrt(head_dim),
                )[0].transpose(0, 1)
            )
            start = end
        return torch.cat(outs).view(total, hidden)


class _Projection(nn.Module):
    """A dense layer, then the residual added and LayerNorm (BERT's post-norm)."""

    def __init__(self, cfg: BertConfig, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.LayerNorm(self.dense(x) + residual)
        return out


class _Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _Projection(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        out: torch.Tensor = self.output(self.self(x, lengths), x)
        return out


class _Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _Projection(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.attention(x, lengths)
        out: torch.Tensor = self.output(self.intermediate(x), x)
        return out


class _Encoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))


class BertEncoder(nn.Module):
    """`forward(input_ids [B, T], mask [B, T] bool) -> hidden states [B, T, hidden]` for a
    batch padded on the right; `packed(rows)` -> [sum of lengths, hidden]. Both run the real
    tokens only."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_position_embeddings
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A batch padded on the right ([B, T], `mask` True on the real tokens), run packed:
        [B, T, hidden], zeros where the mask is False."""
        lengths = mask.sum(1).tolist()
        kinds = token_type_ids[mask] if token_type_ids is not None else None
        return _padded(self._encode(input_ids[mask], kinds, lengths), mask)

    def packed(self, rows: list[list[int]], types: list[list[int]] | None = None) -> torch.Tensor:
        """The rows' hidden states one after another, [sum of lengths, hidden]: every matrix
        product runs over the real tokens only (a padded batch of inputs of mixed lengths
        multiplies its padding too), and attention runs per input. `types`: each row's token
        type ids (segment A 0, B 1); zeros without."""
        device = self.embeddings.word_embeddings.weight.device
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)
        kinds = (
            torch.tensor([t for r in types for t in r], dtype=torch.long, device=device)
            if types is not None
            else None
        )
        return self._encode(ids, kinds, [len(r) for r in rows])

    def _encode(
        self, ids: torch.Tensor, kinds: torch.Tensor | None, lengths: list[int]
    ) -> torch.Tensor:
        positions = torch.cat([torch.arange(n) for n in lengths]).to(ids.device)
        x: torch.Tensor = self.embeddings(
            ids, torch.zeros_like(ids) if kinds is None else kinds, positions
        )
        for layer in self.encoder.layer:
            x = layer(x, lengths)
        return x

    @torch.inference_mode()
    def hidden_states(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' hidden states (computed packed, without padding), laid out padded on the
        right for pooling: ([B, T, hidden] float, mask [B, T])."""
        device = self.embeddings.word_embeddings.weight.device
        lengths = torch.tensor([len(r) for r in rows])
        mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).to(device)
        return _padded(self.packed(rows).float(), mask), mask


def _padded(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, hidden] states in the order of `mask`'s True cells, row after row, into [B, T,
    hidden] with zeros elsewhere."""
    out = flat.new_zeros(*mask.shape, flat.shape[-1])
    out[mask] = flat
    return out


def load_bert(
    path: Path, cfg: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> BertEncoder:
    """The encoder from `path`'s safetensors; every tensor it needs present, shapes checked."""
    with torch.device("meta"):
        model = BertEncoder(BertConfig.from_dict(cfg))

    def rename(key: str) -> str | None:
        name = key.removeprefix(_PREFIX)
        return None if name.startswith(_UNUSED) else name

    return load_weights(model, path, dtype, device, rename)


_Module = TypeVar("_Module", bound=nn.Module)


def load_weights(
    model: _Module,
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    rename: Callable[[str], str | None],
) -> _Module:
    """`model` (built on the meta device) given `path`'s safetensors, each key renamed to its
    parameter (None, or a name the model lacks: not used); shapes checked, none missing."""
    from safetensors import safe_open

    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {str(path)!r} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = rename(key)
                if name is None or name not in expected:
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != expected[name]:
                    raise ModelLoadError(
                        f"tensor {key!r} has shape {list(shape)}, expected {list(expected[name])}"
                    )
                state[name] = f.get_tensor(key).to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"missing tensors in checkpoint: {', '.join(missing[:8])}")
    model.load_state_dict(state, assign=True)
    return model.eval()
