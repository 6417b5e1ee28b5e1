"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE), with HF parameter names.

Routing is transformers': the router's logits, a softmax in float32, `torch.topk` (so ties go
where torch.topk sends them), the top k renormalised when the model asks (`norm_topk_prob`;
always for Mixtral), and for the Qwen models the weights cast back to the hidden dtype.

The experts run grouped, never token by token: the (token, expert) assignments are sorted by
expert, each expert that received tokens runs once on its rows, and one `index_add_` sums the
weighted rows back in expert order (transformers' order of summation). Skipping the experts
with no tokens needs their counts on the host; on a CPU that is a plain read of a CPU tensor
(the forward runs on the CPU stream that owns it, and the schedule path is not involved). On
any other device counting would synchronise with the stream, so every expert runs on every
token there with a zero weight where it was not chosen: no device read, more arithmetic.

Each expert is its own pair of `nn.Linear`s (the checkpoint's `experts.N.*` names), so weight
quantization (`LlamaForCausalLM.quantize`) swaps them like any other linear layer; the routers
are not `nn.Linear` and stay dense (routing is the most sensitive product). `fuse_projections`
leaves the experts unfused.

Tensor parallelism shards every expert as LlamaMLP is sharded (gate and up by output rows, down
by input columns, each expert's intermediate size split in padded ranges; parallel.mlp_width)
with the routers replicated, so every rank routes alike and one all-reduce sums the block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.runtime.model.parallel import padded_shard_len

if TYPE_CHECKING:
    from stallfree.runtime.model.arch import ModelArchConfig
    from stallfree.runtime.model.moe_config import MoEConfig
    from stallfree.runtime.model.parallel import TPGroup


class Router(nn.Module):
    """`weight` [outputs, hidden] applied as a matmul; not an `nn.Linear`, so never quantized."""

    def __init__(self, outputs: int, hidden: int, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Expert(nn.Module):
    """One SwiGLU expert whose three projections carry the checkpoint's names (gate, up, down)."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str], **factory: Any):
        """`inter`: this rank's shard of the expert's intermediate size (all of it at tp 1)."""
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False, **factory))
        setattr(self, up, nn.Linear(hidden, inter, bias=False, **factory))
        setattr(self, down, nn.Linear(inter, hidden, bias=False, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # looked up on each call: quantize() may have swapped the layers in place
        gate, up, down = (cast(nn.Module, getattr(self, n)) for n in self.names)
        out: torch.Tensor = down(F.silu(gate(x)) * up(x))
        return out


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) of each token, as transformers routes."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if moe.style != "mixtral":  # Mixtral keeps its weights in float32
        top = top.to(logits.dtype)
    return top, ids


class SparseMoeBlock(nn.Module):
    """`gate` (the router), `experts.N`, and for Qwen2-MoE `shared_expert` (a dense MLP)
    scaled by sigmoid(`shared_expert_gate`) and added to the routed experts' sum."""

    def __init__(
        self,
        arch: ModelArchConfig,
        tp: TPGroup,
        dense_mlp: Callable[..., nn.Module],
        **factory: Any,
    ) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.moe = moe
        self.tp = tp
        hidden = arch.hidden_size
        self.gate = Router(moe.num_experts, hidden, **factory)
        inter = padded_shard_len(moe.expert_intermediate_size, tp.size)
        self.experts = nn.ModuleList(
            Expert(hidden, inter, moe.expert_names, **factory) for _ in range(moe.num_experts)
        )
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: Router | None = None
        if moe.shared_expert_intermediate_size:
            shared = replace(arch, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert = dense_mlp(shared, tp, **factory)
            self.shared_expert_gate = Router(1, hidden, **factory)
        # False: the device-read-free path (every expert on every token); tests force it on CPUs
        self.group_on_host = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe)
        if self.group_on_host and x.device.type == "cpu":
            out = self._grouped(x, weights, ids)
        else:
            out = self._every_expert(x, weights, ids)
        # each rank routes the same (replicated router, same input) and holds a slice of every
        # expert's intermediate dimension: its sum is partial until the all-reduce
        out = self.tp.all_reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each expert once, on the rows routed to it (assignments sorted by expert)."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // k  # the token of each sorted assignment
        w = weights.reshape(-1).index_select(0, order)
        xs = x.index_select(0, rows)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # a CPU tensor
        parts = []
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                end = start + n
                parts.append(expert(xs[start:end]) * w[start:end, None])
                start = end
        if not parts:  # no tokens
            return torch.zeros_like(x)
        y = torch.cat(parts) if len(parts) > 1 else parts[0]
        return torch.zeros_like(x).index_add_(0, rows, y.to(x.dtype))

    def _every_expert(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every token, weighted zero where not chosen: nothing read back."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            # at most one non-zero term per row, so the sum is that weight exactly
            w = (weights * (ids == e)).sum(dim=-1)
            out = out + (expert(x) * w[:, None]).to(x.dtype)
        return out


def add_mlp(
    layer: nn.Module,
    arch: ModelArchConfig,
    layer_id: int,
    tp: TPGroup,
    dense_mlp: Callable[..., nn.Module],
    **factory: Any,
) -> None:
    """Give a decoder layer its feed-forward block as `layer.mlp`: `dense_mlp(arch, tp)`, or a
    `SparseMoeBlock` on the layers an MoE model routes. Mixtral's block is registered under
    its HF name `block_sparse_moe`, with `mlp` an unregistered alias of it (one set of
    parameter names)."""
    moe = arch.moe
    if moe is None or not moe.is_sparse(layer_id):
        layer.mlp = dense_mlp(arch, tp, **factory)
        return
    block = SparseMoeBlock(arch, tp, dense_mlp, **factory)
    setattr(layer, moe.module_name, block)
    if moe.module_name != "mlp":
        layer.__dict__["mlp"] = block
