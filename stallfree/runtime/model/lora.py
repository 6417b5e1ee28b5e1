"""LoRA deltas on the decoder's projections, for many adapters in one batch.

Every adapted projection is wrapped once (`LoraProjection`): its base output, plus
`scale * B(A(x))` of each token's own adapter. Adapter weights sit in `max_loras` slots of
stacked tensors per projection part (A [slots, max_rank, in], B [out, slots, max_rank], the
scale folded into B); a slot holds an adapter of any rank up to the maximum, zero-padded. A
fused projection (`qkv_proj`, `gate_up_proj`) has one part per projection it stacks, each adding
into its own columns of the fused output.

A step's rows by adapter (`LoraBatch`, built on the host at launch) are read by every wrapper of
that forward. While the used slots' ranks side by side are small beside the input width, every
adapter runs in one pass over the whole batch: x times the used slots' A side by side, each
token's columns of other adapters masked to zero, times their B side by side (two products per
part, however many adapters). Past that, each adapter's rows run apart at its own rank. The
slots are written only by work enqueued on the stream (`LoraSlots.write`), so a launched step
never sees a slot change under it.

Under tensor parallelism each rank holds A and B cut as their base layer is (`cut_for_rank`):
a column-parallel projection (q, k, v, gate, up) keeps all of A and its rows of B, a
row-parallel one (o, down) its columns of A and all of B. A row-parallel delta is added to the
rank's partial product before the all-reduce (`LoraProjection.matmul`), so the sum over the
ranks counts it once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.runtime.model import native_layers
from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.model.forward_batch import LoraBatch
from stallfree.runtime.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from stallfree.runtime.model.parallel import TPGroup, apply_shard, shard_spec
from stallfree.runtime.model.quant import Int4Linear, Int8Linear

# the two-product path over the whole batch runs while the used slots' ranks side by side are
# at most this share of the input width (its extra work over the base projection); past it,
# each adapter's rows run apart
DENSE_MAX_SHARE = 4

# PEFT's module names for the projections an adapter may target
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

# an adapter's weights: (A [r, in], B [out, r], scale) by (layer, target)
Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


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
    order, with each one's output width. Per part, A is [slots, max_rank, in] and B
    [out, slots, max_rank], so every slot's A rows and B columns side by side are plain views."""

    def __init__(
        self,
        base: Callable[[torch.Tensor], torch.Tensor] | None,
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
        self.in_features, self.slots, self.max_rank = in_features, slots, max_rank
        self.a = nn.ParameterList(
            nn.Parameter(torch.zeros(slots, max_rank, in_features, **factory), False) for _ in parts
        )
        # B with the adapter's scale folded in (merged weights are W + scale * B A too)
        self.b = nn.ParameterList(
            nn.Parameter(torch.zeros(w, slots, max_rank, **factory), False) for _, w in parts
        )
        self.state = [[SlotPart() for _ in parts] for _ in range(slots)]

    def write(
        self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float
    ) -> None:
        """Slot `slot`'s weights for part `part` (None: the adapter leaves that part alone).
        Runs on the stream."""
        a_slot, b_slot = self.a[part][slot], self.b[part][:, slot]
        a_slot.zero_()
        b_slot.zero_()
        if a is None or b is None:
            self.state[slot][part] = SlotPart()
            return
        rank = int(a.shape[0])
        a_slot[:rank].copy_(a)
        b_slot[:, :rank].copy_(b * scale)
        self.state[slot][part] = SlotPart(rank, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.base is not None
        return self.add_deltas(x, self.base(x))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel rank's partial product without the bias, its deltas added: what
        llama.py's `_row_parallel` all-reduces for a layer that is not a plain `nn.Linear`
        (a quantized one has this method too). Each rank's A holds its input columns, so the
        deltas sum over the ranks to the whole delta, added once."""
        base = self.base
        if isinstance(base, nn.Linear):
            return self.add_deltas(x, F.linear(x, base.weight))
        assert isinstance(base, Int8Linear | Int4Linear)
        return self.add_deltas(x, base.matmul(x))

    @property
    def bias(self) -> torch.Tensor | None:
        """The base layer's bias (replicated: added once, after the all-reduce)."""
        assert isinstance(self.base, nn.Module)
        bias = self.base.bias
        assert bias is None or isinstance(bias, torch.Tensor)
        return bias

    def add_deltas(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x`, every part side by side) plus each token's
        adapter's deltas, in place."""
        batch = self.context.batch
        if batch is None:
            return out
        if len(batch.slots) * self.max_rank * DENSE_MAX_SHARE <= self.in_features:
            self._dense(x, out, batch)
        else:
            self._by_slot(x, out, batch)
        return out

    def _dense(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        """Every adapter of the step in two products over the whole batch: x through the used
        slots' A side by side, each token's columns outside its own slot masked to zero, then
        through their B side by side (the padded ranks and the masked columns add nothing)."""
        k, r = len(batch.slots), self.max_rank
        mask = _mask(batch, r, x.dtype)
        start = 0
        for p, (_, width) in enumerate(self.parts):
            if any(self.state[s][p].rank for s in batch.slots):
                a, b = self.a[p], self.b[p]
                if k < self.slots:
                    a, b = a.index_select(0, batch.slot_index), b.index_select(1, batch.slot_index)
                xa = F.linear(x, a.reshape(k * r, -1)) * mask
                out[:, start : start + width].add_(F.linear(xa, b.reshape(width, k * r)))
            start += width

    def _by_slot(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        """Each adapter's rows apart, at its own rank (many adapters of a high rank)."""
        for slot, rows in batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            start = 0
            for p, (_, width) in enumerate(self.parts):
                rank = self.state[slot][p].rank
                if rank:
                    a, b = self.a[p][slot, :rank], self.b[p][:, slot, :rank]
                    delta = F.linear(F.linear(xs, a), b)  # B(A(x)), as PEFT orders it
                    cols = out[:, start : start + width]
                    if rows is None:
                        cols.add_(delta)
                    else:
                        cols.index_add_(0, rows, delta)
                start += width


def _mask(batch: LoraBatch, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, slots in use x rank]: 1 where a column belongs to the token's own adapter (made
    once per step, on the stream)."""
    key = (rank, dtype)
    mask = batch.masks.get(key)
    if mask is None:
        groups = batch.token_groups
        cols = torch.arange(len(batch.slots), device=groups.device).repeat_interleave(rank)
        mask = (groups[:, None] == cols[None, :]).to(dtype)
        batch.masks[key] = mask
    return mask


def cut_for_rank(weights: Weights, arch: ModelArchConfig, tp: TPGroup) -> Weights:
    """A whole adapter's weights cut to a tensor-parallel rank's shards, as the base weights
    are (`parallel.shard_spec`, zero-padded alike): a column-parallel target's B by its output
    rows, a row-parallel target's A by its input columns; the other side whole."""
    if tp.size == 1:
        return weights
    out: Weights = {}
    for (layer, target), (a, b, scale) in weights.items():
        block = "self_attn" if target in _ATTENTION else "mlp"
        spec = shard_spec(f"model.layers.{layer}.{block}.{target}.weight", arch, tp.rank, tp.size)
        if spec is not None and spec.dim == 0:
            b = apply_shard(b, spec)
        elif spec is not None:
            a = apply_shard(a, spec)
        out[(layer, target)] = (a, b, scale)
    return out


@dataclass(slots=True, eq=False)
class LoraSlots:
    """Every wrapped projection of a model, by (layer, PEFT target name): the projection and
    the index of that target's part in it. `arch` and `tp`: the model's, to cut a whole
    adapter to this rank's shards."""

    context: LoraContext
    arch: ModelArchConfig
    tp: TPGroup
    targets: dict[tuple[int, str], tuple[LoraProjection, int]] = field(default_factory=dict)
    shapes: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)  # (in, out)
    # (module, attribute, its plain value, its wrapper): the wrappers are in place only for a
    # step with adapter rows, so a step without any runs the model as it was. A plain value
    # of None: the wrapper overrides a method on the instance (`_JointQKV`, `_MlpForward`)
    sites: list[tuple[nn.Module, str, nn.Module | None, Callable[..., torch.Tensor]]] = field(
        default_factory=list
    )
    wrapped: bool = False

    def write(self, slot: int, weights: Weights) -> None:
        """Slot `slot` holds this adapter now: (A [r, in], B [out, r], scale) per target it
        adapts, whole (this rank's shards are cut here); every other target's part is off.
        Runs on the stream."""
        weights = cut_for_rank(weights, self.arch, self.tp)
        for key, (proj, part) in self.targets.items():
            got = weights.get(key)
            if got is None:
                proj.write(slot, part, None, None, 0.0)
            else:
                proj.write(slot, part, *got)

    def set_batch(self, batch: LoraBatch | None) -> None:
        """The forward's batch; the wrappers put in place or taken out to match."""
        self.context.batch = batch
        wanted = batch is not None
        if wanted != self.wrapped:
            for owner, name, plain, wrapper in self.sites:
                if plain is not None:
                    setattr(owner, name, wrapper if wanted else plain)
                elif wanted:
                    owner.__dict__[name] = wrapper  # found before the class's method
                else:
                    owner.__dict__.pop(name, None)
            self.wrapped = wanted


class _JointQKV:
    """An unfused attention's q, k and v side by side as its `joint_qkv` makes them (one
    grouped native call where it applies), else the three calls concatenated."""

    def __init__(self, attn: LlamaAttention) -> None:
        self.attn = attn

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        attn = self.attn
        out = type(attn).joint_qkv(attn, h)
        if out is None:
            out = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
        return out


class _MlpForward:
    """An unfused `LlamaMLP`'s forward with the gate/up deltas added between its (grouped)
    gate and up projection and the activation; `down_proj` is wrapped on its own."""

    def __init__(self, mlp: LlamaMLP, gate_up: LoraProjection) -> None:
        self.mlp, self.gate_up = mlp, gate_up

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        gate_up = native_layers.grouped([mlp.gate_proj, mlp.up_proj], x)
        if gate_up is None:
            gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        gate_up = self.gate_up.add_deltas(x, gate_up)
        h = native_layers.silu_mul(gate_up)
        down = mlp.down_proj  # its wrapper, in place while this is
        if mlp.tp.size == 1:
            out: torch.Tensor = down(h)
            return out
        assert isinstance(down, LoraProjection)
        reduced = mlp.tp.all_reduce(down.matmul(h))
        return reduced if down.bias is None else reduced + down.bias


# (module owning the projection, its attribute, its parts (target, width), its input width)
_Group = tuple[nn.Module, str, list[tuple[str, int]], int]


def install(model: LlamaForCausalLM, slots: int, max_rank: int, dtype: torch.dtype) -> LoraSlots:
    """A LoRA wrapper for every attention and dense MLP projection of a Llama-family model
    (fused ones included), in place for the forwards whose `fb.lora` has adapter rows."""
    context = LoraContext()
    table = LoraSlots(context, model.arch, model.tp)
    # the activations' dtype: a quantized model's first weight may be int8
    factory = {"device": model.model.norm.weight.device, "dtype": dtype}
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        for owner, name, parts, width in _groups(layer, model.arch.hidden_size):
            if name == "joint_qkv":
                assert isinstance(owner, LlamaAttention)
                proj = LoraProjection(
                    _JointQKV(owner), parts, width, slots, max_rank, context, **factory
                )
                table.sites.append((owner, name, None, proj))
            elif name == "forward":
                assert isinstance(owner, LlamaMLP)
                proj = LoraProjection(None, parts, width, slots, max_rank, context, **factory)
                table.sites.append((owner, name, None, _MlpForward(owner, proj)))
            else:
                base = getattr(owner, name)
                proj = LoraProjection(base, parts, width, slots, max_rank, context, **factory)
                table.sites.append((owner, name, base, proj))
            for p, (target, out) in enumerate(parts):
                table.targets[(i, target)] = (proj, p)
                table.shapes[(i, target)] = (width, out)
    model.register_forward_pre_hook(lambda _m, args: table.set_batch(args[0].lora))
    model.register_forward_hook(lambda _m, _args, _out: table.set_batch(None))
    return table


def target_shapes(model: LlamaForCausalLM) -> dict[tuple[int, str], tuple[int, int]]:
    """(in, out) of every projection an adapter may target, by (layer, target), as `model`
    holds them: the whole model's on one rank (or built on the meta device), a rank's shards
    under tensor parallelism."""
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        for _, _, parts, width in _groups(layer, model.arch.hidden_size):
            shapes.update({(i, target): (width, out) for target, out in parts})
    return shapes


def _groups(layer: LlamaDecoderLayer, hidden: int) -> list[_Group]:
    """A layer's projections as they run: q/k/v and gate/up fused or apart; an MoE block's
    experts are not adapted."""
    attn, mlp = layer.self_attn, layer.mlp
    q_out, kv_out = attn.qkv_split[0], attn.qkv_split[1]
    qkv = [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)]
    groups: list[_Group] = []
    # unfused q/k/v: one wrapper over `joint_qkv`, which keeps its grouped native call
    groups.append((attn, "qkv_proj" if attn.qkv_proj is not None else "joint_qkv", qkv, hidden))
    groups.append((attn, "o_proj", [("o_proj", hidden)], q_out))
    if isinstance(mlp, LlamaMLP):
        inter = mlp.inter
        gate_up = [("gate_proj", inter), ("up_proj", inter)]
        if mlp.gate_up_proj is not None:
            groups.append((mlp, "gate_up_proj", gate_up, hidden))
        elif type(mlp) is LlamaMLP:  # its own forward, with the grouped gate/up call kept
            groups.append((mlp, "forward", gate_up, hidden))
        else:  # a family's own MLP (its activation): each projection wrapped
            groups += [(mlp, n, [(n, w)], hidden) for n, w in gate_up]
        groups.append((mlp, "down_proj", [("down_proj", hidden)], inter))
    return groups
