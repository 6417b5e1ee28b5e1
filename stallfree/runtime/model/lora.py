"""LoRA deltas on the decoder's projections, for many adapters in one batch.

Every adapted projection is wrapped once (`LoraProjection`): its base output, plus, for each
adapter slot the step's rows use, `scale * B(A(x))` over that slot's token rows. Adapter weights
sit in `max_loras` slots of stacked tensors (A [slots, max_rank, in], B [slots, out, max_rank]
per projection part); a slot holds an adapter of any rank up to the maximum (the host knows
each slot's ranks, so the products run at the adapter's own rank). A fused projection
(`qkv_proj`, `gate_up_proj`) has one part per projection it stacks, each adding into its own
columns of the fused output.

The step's grouping of token rows by slot (`LoraBatch`) is built on the host at launch and read
by every wrapper of that forward; the slots are written only by work enqueued on the stream
(`LoraSlots.write`), so a launched step never sees a slot change under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.runtime.model.forward_batch import LoraBatch
from stallfree.runtime.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

# PEFT's module names for the projections an adapter may target
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True, eq=False)
class LoraContext:
    """What the wrappers of one model share: the batch of the forward running now."""

    batch: LoraBatch | None = None


@dataclass(slots=True, eq=False)
class SlotPart:
    """A slot's state for one part of a projection: its rank (0: the adapter does not adapt
    it) and its scale."""

    rank: int = 0
    scale: float = 0.0


class LoraProjection(nn.Module):
    """A projection and its LoRA parts: `parts` names the projections it computes, in column
    order, with each one's output width."""

    def __init__(
        self,
        base: nn.Module,
        parts: list[tuple[str, int]],
        in_features: int,
        slots: int,
        max_rank: int,
        context: LoraContext,
        **factory: Any,
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.context = context
        self.a = nn.ParameterList(
            nn.Parameter(torch.zeros(slots, max_rank, in_features, **factory), False) for _ in parts
        )
        self.b = nn.ParameterList(
            nn.Parameter(torch.zeros(slots, n, max_rank, **factory), False) for _, n in parts
        )
        self.state = [[SlotPart() for _ in parts] for _ in range(slots)]

    def write(
        self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float
    ) -> None:
        """Slot `slot`'s weights for part `part` (None: the adapter leaves that part alone).
        Runs on the stream."""
        if a is None or b is None:
            self.state[slot][part] = SlotPart()
            return
        rank = int(a.shape[0])
        self.a[part][slot, :rank].copy_(a)
        self.b[part][slot, :, :rank].copy_(b)
        self.state[slot][part] = SlotPart(rank, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        batch = self.context.batch
        if batch is None:
            return out
        for slot, rows in batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            start = 0
            for p, (_, width) in enumerate(self.parts):
                part = self.state[slot][p]
                if part.rank:
                    a = self.a[p][slot, : part.rank]
                    b = self.b[p][slot, :, : part.rank]
                    # PEFT's order: B(A(x)) then the scale
                    delta = F.linear(F.linear(xs, a), b) * part.scale
                    cols = out[:, start : start + width]
                    if rows is None:
                        cols.add_(delta)
                    else:
                        cols.index_add_(0, rows, delta)
                start += width
        return out


@dataclass(slots=True, eq=False)
class LoraSlots:
    """Every wrapped projection of a model, by (layer, PEFT target name): the projection and
    the index of that target's part in it."""

    context: LoraContext
    targets: dict[tuple[int, str], tuple[LoraProjection, int]] = field(default_factory=dict)
    shapes: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)  # (in, out)

    def write(
        self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    ) -> None:
        """Slot `slot` holds this adapter now: (A [r, in], B [out, r], scale) per target it
        adapts; every other target's part is off. Runs on the stream."""
        for key, (proj, part) in self.targets.items():
            got = weights.get(key)
            if got is None:
                proj.write(slot, part, None, None, 0.0)
            else:
                proj.write(slot, part, *got)

    def set_batch(self, batch: LoraBatch | None) -> None:
        self.context.batch = batch


# (module owning the projection, its attribute, its parts (target, width), its input width)
_Group = tuple[nn.Module, str, list[tuple[str, int]], int]


def install(model: LlamaForCausalLM, slots: int, max_rank: int) -> LoraSlots:
    """Wrap every attention and dense MLP projection of a Llama-family model (fused ones
    included) in place; the forward takes its `LoraBatch` from `fb.lora`."""
    context = LoraContext()
    table = LoraSlots(context)
    weight = next(model.parameters())
    factory = {"device": weight.device, "dtype": weight.dtype}
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        for owner, name, parts, width in _groups(layer, model.arch.hidden_size):
            base = getattr(owner, name)
            proj = LoraProjection(base, parts, width, slots, max_rank, context, **factory)
            setattr(owner, name, proj)
            for p, (target, out) in enumerate(parts):
                table.targets[(i, target)] = (proj, p)
                table.shapes[(i, target)] = (width, out)
    model.register_forward_pre_hook(lambda _m, args: table.set_batch(args[0].lora))
    model.register_forward_hook(lambda _m, _args, _out: table.set_batch(None))
    return table


def _groups(layer: LlamaDecoderLayer, hidden: int) -> list[_Group]:
    """A layer's projections as they run: q/k/v and gate/up fused or apart; an MoE block's
    experts are not adapted."""
    attn, mlp = layer.self_attn, layer.mlp
    q_out, kv_out = attn.qkv_split[0], attn.qkv_split[1]
    qkv = [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)]
    groups: list[_Group] = []
    if attn.qkv_proj is not None:
        groups.append((attn, "qkv_proj", qkv, hidden))
    else:
        groups += [(attn, n, [(n, w)], hidden) for n, w in qkv]
    groups.append((attn, "o_proj", [("o_proj", hidden)], q_out))
    if isinstance(mlp, LlamaMLP):
        inter = mlp.inter
        gate_up = [("gate_proj", inter), ("up_proj", inter)]
        if mlp.gate_up_proj is not None:
            groups.append((mlp, "gate_up_proj", gate_up, hidden))
        else:
            groups += [(mlp, n, [(n, w)], hidden) for n, w in gate_up]
        groups.append((mlp, "down_proj", [("down_proj", hidden)], inter))
    return groups
