"""Tensor parallelism for the model: the rank's group, its collectives, and the sharding rules.

`TPGroup()` (size 1) is the in-process default: its collectives return their input and it never
touches `torch.distributed`. `TPGroup.from_distributed()` is built inside a worker process after
`torch.distributed.init_process_group` has run.

Sharding (see docs/tensor_parallel.md):
- query heads split evenly: `num_heads % tp_size == 0`;
- KV heads split evenly when `num_kv_heads % tp_size == 0`; when `num_kv_heads < tp_size` (and
  `tp_size % num_kv_heads == 0`) each rank holds the one KV head its query heads read, so a KV
  head is replicated on `tp_size // num_kv_heads` ranks;
- the intermediate (MLP) dimension and the vocabulary split into contiguous ranges of
  `ceil(total / tp_size)`; the last range may be shorter (the vocabulary shard is zero-padded
  so every rank's logits slice has the same width for the all-gather).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from stallfree.runtime.model.arch import FAMILIES, ModelLoadError

if TYPE_CHECKING:
    from stallfree.runtime.model.arch import ModelArchConfig


@dataclass(slots=True)
class CommStats:
    """Cumulative collective figures of one rank (host wall time around each call).

    On gloo (CPU) a collective returns when it is done, so the seconds are its full cost. On NCCL
    the call only enqueues work on the device stream: the seconds are the launch cost, not the
    transfer; the bytes are exact either way.
    """

    all_reduce_calls: int = 0
    all_reduce_seconds: float = 0.0
    all_reduce_bytes: int = 0  # bytes of the tensors reduced (each rank's input size)
    all_gather_calls: int = 0
    all_gather_seconds: float = 0.0
    all_gather_bytes: int = 0  # bytes of each rank's input shard

    def snapshot(self) -> CommStats:
        return CommStats(*(getattr(self, f.name) for f in fields(self)))

    def delta(self, since: CommStats) -> CommStats:
        """What happened after `since` (an earlier snapshot): per-step figures."""
        return CommStats(*(getattr(self, f.name) - getattr(since, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TPGroup:
    """One rank's view of its tensor-parallel group.

    `all_reduce(t)` sums `t` over the ranks in place and returns it; `all_gather(t, dim)`
    concatenates every rank's `t` along `dim` (rank order). Both are no-ops at size 1.
    """

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid tensor-parallel rank {rank} of size {size}")
        self.rank = rank
        self.size = size
        self.group = group  # a torch.distributed ProcessGroup, or None for the default group
        self.stats = CommStats()

    @classmethod
    def from_distributed(cls, group: Any = None) -> TPGroup:
        """The calling process's rank and size in `group` (default: the world group)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        stats = self.stats
        stats.all_reduce_seconds += time.perf_counter() - start
        stats.all_reduce_calls += 1
        stats.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return t
        import torch.distributed as dist

        start = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        out = torch.cat(parts, dim=dim)
        stats = self.stats
        stats.all_gather_seconds += time.perf_counter() - start
        stats.all_gather_calls += 1
        stats.all_gather_bytes += t.numel() * t.element_size()
        return out

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"


def tp_size_of(tp: TPGroup | int | None) -> int:
    if tp is None:
        return 1
    return tp if isinstance(tp, int) else tp.size


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rank's contiguous [start, end) of `total` items in chunks of ceil(total / size).

    The last ranks' ranges may be shorter (or empty when size > total).
    """
    per = -(-total // size)
    start = min(total, rank * per)
    return start, min(total, start + per)


def padded_shard_len(total: int, size: int) -> int:
    """Every rank's shard length for a dimension split by `shard_range`, padded to the longest."""
    return -(-total // size)


def validate_tp(arch: ModelArchConfig, tp_size: int) -> None:
    """Raise `ModelLoadError` (a ValueError) when `arch` cannot be split over `tp_size` ranks."""
    heads, kv_heads = arch.num_heads, arch.num_kv_heads
    if tp_size < 1:
        raise ModelLoadError(f"tensor-parallel size must be >= 1, got {tp_size}")
    family = FAMILIES.get(arch.architecture)
    if tp_size > 1 and family is not None and not family.tensor_parallel:
        raise ModelLoadError(
            f"{arch.architecture} does not support tensor parallelism yet (tp_size={tp_size}); "
            "use tp_size=1"
        )
    if heads % tp_size:
        raise ModelLoadError(
            f"tensor-parallel size {tp_size} must divide the number of attention heads "
            f"(num_attention_heads={heads})"
        )
    if kv_heads >= tp_size and kv_heads % tp_size:
        raise ModelLoadError(
            f"tensor-parallel size {tp_size} must divide the number of KV heads "
            f"(num_key_value_heads={kv_heads}) when it is not larger than it"
        )
    if kv_heads < tp_size and tp_size % kv_heads:
        raise ModelLoadError(
            f"num_key_value_heads={kv_heads} must divide the tensor-parallel size {tp_size} "
            f"to replicate KV heads across ranks"
        )


def local_heads(arch: ModelArchConfig, tp: TPGroup | int | None) -> int:
    """Query heads held by each rank."""
    size = tp_size_of(tp)
    validate_tp(arch, size)
    return arch.num_heads // size


def local_kv_heads(arch: ModelArchConfig, tp: TPGroup | int | None) -> int:
    """KV heads held by each rank (and so the KV cache's head count on each rank)."""
    size = tp_size_of(tp)
    validate_tp(arch, size)
    return max(1, arch.num_kv_heads // size)


def head_range(arch: ModelArchConfig, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the query heads on `rank`."""
    n = local_heads(arch, size)
    return rank * n, (rank + 1) * n


def kv_head_range(arch: ModelArchConfig, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the KV heads on `rank`: its own slice, or the one head its queries read."""
    n = local_kv_heads(arch, size)
    if arch.num_kv_heads >= size:
        return rank * n, (rank + 1) * n
    head = rank // (size // arch.num_kv_heads)
    return head, head + 1


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """The rank's slice of a full parameter: `[start, end)` along `dim`, zero-padded to `length`."""

    dim: int
    start: int
    end: int
    length: int


def shard_spec(name: str, arch: ModelArchConfig, rank: int, size: int) -> ShardSpec | None:
    """How parameter `name` (a Hugging Face name) is split; None: every rank holds all of it."""
    if size == 1:
        return None
    d = arch.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start, end = shard_range(arch.vocab_size, rank, size)
        return ShardSpec(0, start, end, padded_shard_len(arch.vocab_size, size))
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    module, kind = leaf[0], leaf[-1]
    if module == "q_proj":
        h0, h1 = head_range(arch, rank, size)
        return ShardSpec(0, h0 * d, h1 * d, (h1 - h0) * d)
    if module in ("k_proj", "v_proj"):
        h0, h1 = kv_head_range(arch, rank, size)
        return ShardSpec(0, h0 * d, h1 * d, (h1 - h0) * d)
    if module == "o_proj":
        if kind == "bias":
            return None  # added once, after the all-reduce
        h0, h1 = head_range(arch, rank, size)
        return ShardSpec(1, h0 * d, h1 * d, (h1 - h0) * d)
    if module in _COLUMN_MLP or module in _ROW_MLP:
        width = mlp_width(name, arch)
        start, end = shard_range(width, rank, size)
        length = padded_shard_len(width, size)
        return ShardSpec(1 if module in _ROW_MLP else 0, start, end, length)
    return None


# an MLP's projections by their HF names (Mixtral's experts: w1 gate, w3 up, w2 down)
_COLUMN_MLP = ("gate_proj", "up_proj", "w1", "w3")
_ROW_MLP = ("down_proj", "w2")


def mlp_width(name: str, arch: ModelArchConfig) -> int:
    """The intermediate size of the MLP that parameter `name` belongs to: a routed expert's,
    an MoE shared expert's (moe.py), or the dense `intermediate_size`."""
    if arch.moe is not None:
        if ".experts." in name:
            return arch.moe.expert_intermediate_size
        if ".shared_expert." in name:
            return arch.moe.shared_expert_intermediate_size
    return arch.intermediate_size


def apply_shard(full: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The rank's slice of a full tensor (zero-padded to the spec's length)."""
    if spec is None:
        return full
    part = full.narrow(spec.dim, spec.start, spec.end - spec.start)
    return pad_shard(part, spec)


def pad_shard(part: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    missing = spec.length - part.shape[spec.dim]
    if missing == 0:
        return part.contiguous()
    shape = list(part.shape)
    shape[spec.dim] = missing
    return torch.cat([part, part.new_zeros(shape)], dim=spec.dim)
