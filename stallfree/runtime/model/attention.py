"""Paged attention: K/V live in the KV cache, addressed through `req_to_token` rows.

Everything here is enqueued work: shapes and loops come from the batch's host metadata, and
masks are built by device-side comparisons, so nothing waits for the device.

Grouped-query attention never repeats K/V per query head: `scaled_dot_product_attention` takes
the KV heads as they are (`enable_gqa`, torch >= 2.5; older torch falls back to repeating).
Decode groups rows into length buckets so that no row is padded far past its own length.

On CPU, a decode step given its RoPE tables (`rope=`) is one native call instead
(`torch.ops.stallfree.decode_attention`, runtime/model/csrc/attention.cpp): RoPE, the K/V
write and split-KV attention read straight through `req_to_token`; the torch path stays as
its reference and as the fallback for everything it does not take. A float32 prompt's
attention is native too (`torch.ops.stallfree.prefill_attention`, `attend_prompt`): SDPA's CPU
kernel computes a prompt shorter than its 512-key split in full, above the diagonal included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from stallfree.runtime.model import cpu_kernels
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.rope import rope_rows

if TYPE_CHECKING:
    from stallfree.runtime.memory.pool import KVCache


def _probe_enable_gqa() -> bool:
    """Whether this torch's SDPA takes `enable_gqa` (added in torch 2.5)."""
    q, kv = torch.zeros(1, 2, 1, 1), torch.zeros(1, 1, 1, 1)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


_HAS_ENABLE_GQA = _probe_enable_gqa()

# Decode buckets: a bucket's padded work stays within this factor of its rows' exact lengths...
BUCKET_PAD_RATIO = 1.15
# ...unless merging two adjacent buckets adds less padded work (in K/V elements, per layer)
# than one more bucket costs in per-call overhead.
BUCKET_MERGE_ELEMS = 64 * 1024


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, H, n, D], k/v [B, KVH, L, D] (any strides), H a multiple of KVH -> [B, H, n, D].

    `scale` replaces SDPA's `D ** -0.5`; `softcap` caps the scores (`tanh(s / cap) * cap`)
    before the mask and the softmax, which SDPA cannot do: `_softcapped` computes it."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if softcap is not None:
        return _softcapped(q, k, v, mask, is_causal, scale, softcap)
    if heads == kv_heads:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale
        )
    if _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    groups = heads // kv_heads  # old torch: each KV head repeated for its query group
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _softcapped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    cap: float,
) -> torch.Tensor:
    """Attention with the scores soft-capped (Gemma 2), in transformers' eager order: scale,
    cap, mask, float32 softmax, values."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads != kv_heads:
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (
        q.shape[-1] ** -0.5 if scale is None else scale
    )
    scores = torch.tanh(scores / cap) * cap
    if is_causal:
        n, width = scores.shape[-2], scores.shape[-1]
        mask = causal_mask(width - n, width, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@dataclass(slots=True)
class _Bucket:
    """Decode rows attended together, each padded to the bucket's longest key window."""

    index: torch.Tensor | None  # [n] device: batch rows of the bucket (None: all, in order)
    slots: torch.Tensor  # [n, width] device: KV slots of each row's window (padding masked)
    mask: torch.Tensor | None  # [n, 1, 1, width] device (None: no padding, nothing to mask)


def plan_buckets(lens: list[int], pad_ratio: float, merge_cost: int) -> list[list[int]]:
    """Group row indices by length so each group pads only to its own longest row.

    Rows are taken longest first; a group grows while `rows * longest <= pad_ratio * exact`, so
    total padded work stays within `pad_ratio` of the exact sum. Adjacent groups are then merged
    while the cheapest merge adds less than `merge_cost` padded elements (one call fewer).
    """
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    top = exact = 0
    for i in order:
        n = lens[i]
        if groups and (len(groups[-1]) + 1) * top <= pad_ratio * (exact + n):
            groups[-1].append(i)
            exact += n
        else:
            groups.append([i])
            top = exact = n
    while len(groups) > 1:
        # merging group g + 1 into g pads its rows up to g's longest row
        extra = [
            len(groups[g + 1]) * (lens[groups[g][0]] - lens[groups[g + 1][0]])
            for g in range(len(groups) - 1)
        ]
        g = min(range(len(extra)), key=extra.__getitem__)
        if extra[g] >= merge_cost:
            break
        groups[g] += groups.pop(g + 1)
    return groups


class _GatherWorkspace:
    """Reused output memory for K/V gathers out of the cache.

    A fresh multi-MiB tensor per layer costs more than the gather itself on CPU (the allocator
    hands large blocks back to the OS, so each one page-faults again). Peak memory is what one
    layer's gather needs either way; this keeps the largest one between steps.
    """

    def __init__(self) -> None:
        self._mem: torch.Tensor | None = None

    def gather(self, buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`buf[slots]`: [*slots.shape, *buf.shape[1:]], valid until the next gather."""
        row = buf.shape[1:]
        numel = slots.numel() * buf[0].numel()
        mem = self._mem
        if (
            mem is None
            or mem.numel() < numel
            or mem.dtype != buf.dtype
            or mem.device != buf.device
            or mem.is_inference() != torch.is_inference_mode_enabled()
        ):
            self._mem = mem = torch.empty(numel, dtype=buf.dtype, device=buf.device)
        out = mem[:numel].view(*slots.shape, *row)
        torch.index_select(buf, 0, slots.reshape(-1), out=out.view(-1, *row))
        return out


def _to_device(host: list[int], device: torch.device) -> torch.Tensor:
    cpu = torch.tensor(host, dtype=torch.int64)
    if device.type == "cpu":
        return cpu
    if device.type == "cuda":
        # NOTE: pinned + non_blocking: queued on the current stream, not waited on
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
# caches the native op reads and writes: the weights' dtypes and the quantized rows of
# runtime/memory/kv_format.py (int8 with its scale, fp8 e4m3 and e5m2)
_NATIVE_CACHE_DTYPES = (*_NATIVE_DTYPES, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def native_decode_supported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    req_to_token: torch.Tensor,
) -> bool:
    """Whether `torch.ops.stallfree.decode_attention` takes this step: CPU tensors, float32 or
    bfloat16 (one dtype for q, k, v and the tables; the cache's may differ, or be quantized:
    int8 or fp8 rows), head dims in multiples of 16, no autograd, and the kernels built for
    this machine."""
    cos, signed_sin = rope
    dim = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dim() == 3
        and dim % 16 == 0
        and q.dtype in _NATIVE_DTYPES
        and k.dtype == v.dtype == cos.dtype == signed_sin.dtype == q.dtype
        and k_cache.dtype in _NATIVE_CACHE_DTYPES
        and req_to_token.dtype in (torch.int32, torch.int64)
        and cos.dim() == 3
        and cos.shape[1:] == (1, dim)
        and q.shape[1] % k.shape[1] == 0
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
        and cpu_kernels.available()
    )


def _native_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `torch.ops.stallfree.prefill_attention` takes a prompt's attention: CPU tensors
    with whole heads per row (any row stride), head dims in multiples of 16 up to 256, no
    autograd, not while torch.compile traces, and the kernels built for this machine; float32,
    or bfloat16 with head dims a multiple of 32 where the AMX tiles are in use (the kernel's
    products then run on them), or bfloat16 on a CPU without AMX tiles (the kernel's float32
    vector path). Where the CPU has tiles but they are off, bfloat16 prompts stay on SDPA,
    whose bfloat16 products run on them through oneDNN, about twice as fast as the vector
    path's multiply-adds there. On a Zen 4 (AVX512-BF16, no AMX) it is the other way round:
    SmolLM2's heads (9/3 of 64), two threads, 256 tokens 645 us against SDPA's 1369, 1024 tokens
    8074 against 13284 (bench_attention.py --prompt)."""
    dim = q.shape[-1]
    dtype = q.dtype
    return (
        q.device.type == "cpu"
        and q.dim() == k.dim() == v.dim() == 3
        and dim % 16 == 0
        and dim <= 256
        and dtype == k.dtype == v.dtype
        and dtype in (torch.float32, torch.bfloat16)
        and q.shape[1] % k.shape[1] == 0
        and all(t.stride(-1) == 1 and t.stride(-2) == dim for t in (q, k, v))
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
        and not torch.compiler.is_compiling()
        and cpu_kernels.available()
        and (dtype == torch.float32 or bf16_prompt_native(dim))
    )


def bf16_prompt_native(dim: int) -> bool:
    """A bfloat16 prompt's attention on the native op: on the tiles (head dims a multiple of
    32) where they are in use, or on the vector path where the CPU has no tiles at all."""
    if cpu_kernels.amx():
        return dim % 32 == 0
    return not cpu_kernels.cpu_has_amx()


def attend_prompt(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    first: int = 0,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One request's prompt: q [n, H, D] at positions prefix .. prefix + n - 1, k/v [seq -
    first, KVH, D] at positions first .. seq - 1 -> [n, H, D], causal, each query seeing only
    its last `window` keys when given."""
    if _native_prompt(q, k, v):
        out: torch.Tensor = torch.ops.stallfree.prefill_attention(
            q, k, v, prefix, first, scale, softcap, window
        )
        return out
    if prefix == 0 and first == 0 and window is None:
        return attend(q, k, v, None, scale, softcap)
    mask = causal_mask(prefix, prefix + q.shape[0], q.device, window, first)
    return attend(q, k, v, mask, scale, softcap)


def joint_qk(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, H, D] and k [T, KVH, D] as one view [T, H + KVH, D] where they are neighbouring
    heads of one projection's rows (a joint q/k/v output); None where they are not. A
    dimension of size 1 may carry any stride."""
    t, heads, dim = q.shape
    if (
        k.dtype == q.dtype
        and k.shape[0] == t
        and k.shape[2] == dim
        and q.stride(2) == k.stride(2) == 1
        and q.stride(1) == dim
        and (k.shape[1] == 1 or k.stride(1) == dim)
        and (t == 1 or q.stride(0) == k.stride(0))
        and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
        and k.data_ptr() == q.data_ptr() + heads * dim * q.element_size()
    ):
        return q.as_strided((t, heads + k.shape[1], dim), (q.stride(0), dim, 1))
    return None


def one_token_tail(lens: list[int]) -> int:
    """How many of an extend step's last requests add one token each (a mixed step's decode
    rows, last by construction)."""
    tail = 0
    while tail < len(lens) and lens[len(lens) - 1 - tail] == 1:
        tail += 1
    return tail


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` on q [T, H, D] and k [T, KVH, D]; one pass over both where they are
    neighbouring heads of one projection's rows (`joint_qk`), as the same elementwise
    arithmetic on [T, H + KVH, D], so half the calls."""
    both = joint_qk(q, k)
    if both is not None:
        heads = q.shape[1]
        out = rope_rows(both, *rope)
        return out[:, :heads], out[:, heads:]
    return rope_rows(q, *rope), rope_rows(k, *rope)


def rope_and_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache,
    layer_id: int,
    loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`rope_qk` and `cache.write(layer_id, loc, k, v)` as one native call
    (`torch.ops.stallfree.rope_write`: each token's rotated k heads and v rows copied into the
    cache as the threads rotate them, in place of two index_put calls), with the same bits;
    None where it does not apply: q and k not neighbouring heads of one projection's rows, a
    cache not stored in their dtype (quantized, or another dtype), the kernels off."""
    t, heads, dim = q.shape
    k_cache, v_cache = cache.k_buffers[layer_id], cache.v_buffers[layer_id]
    cos, signed_sin = rope
    both = joint_qk(q, k)
    if not (
        both is not None
        and q.device.type == "cpu"
        and q.dtype in _NATIVE_DTYPES
        and v.dtype == cos.dtype == signed_sin.dtype == q.dtype
        and not cache.format.quantized
        and k_cache.dtype == v_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape[1:] == v_cache.shape[1:] == k.shape[1:]
        and v.shape[0] == t
        and v.stride(2) == 1
        and (v.shape[1] == 1 or v.stride(1) == dim)
        and cos.dim() == 3
        and cos.shape == signed_sin.shape == (t, 1, dim)
        and cos.stride(2) == signed_sin.stride(2) == 1
        and loc.dtype == torch.int64
        and loc.device.type == "cpu"
        and loc.dim() == 1
        and loc.is_contiguous()
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
        and not torch.compiler.is_compiling()
        and cpu_kernels.available()
    ):
        return None
    out: torch.Tensor = torch.ops.stallfree.rope_write(
        both, cos, signed_sin, heads, v, k_cache, v_cache, loc
    )
    return out[:, :heads], out[:, heads:]


class PagedAttention:
    """Default attention backend. q [T, H, D], k/v [T, KVH, D] -> out [T, H, D].

    `takes_rope`: the model hands q and k unrotated with the step's RoPE tables, so that a
    decode step can rotate, write and attend in one native call."""

    takes_rope = True

    def __init__(
        self,
        sliding_window: int | None = None,
        layer_windows: list[int | None] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        """`layer_windows`: each layer's own window (None: full attention), in place of
        `sliding_window` for every layer; `scale` and `softcap` as in `_sdpa`, for all layers."""
        self.sliding_window = sliding_window
        self.layer_windows = layer_windows
        self.scale, self.softcap = scale, softcap
        # Decode buckets depend only on the batch, not the layer: built at the first layer of a
        # forward and reused by the next ones (a layer id not above the last one is a new pass).
        # (one plan per distinct window: alternating sliding layers keep two)
        self._plan_fb: ForwardBatch | None = None
        self._plan_layer = -1
        self._plans: dict[int | None, list[_Bucket]] = {}
        self._k_ws, self._v_ws = _GatherWorkspace(), _GatherWorkspace()
        # an extend step's trailing one-token rows (`_one_token_tail`), for the step it counted
        self._tail_fb: ForwardBatch | None = None
        self._tail_layer = -1
        self._tail = 0

    def _window(self, layer_id: int) -> int | None:
        if self.layer_windows is None:
            return self.sliding_window
        return self.layer_windows[layer_id]

    def _gather_kv(
        self, layer_id: int, fb: ForwardBatch, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots`: [*slots.shape, KVH, D] each, valid until the next gather (or,
        from a quantized cache, decoded into fresh tensors)."""
        cache = fb.kv_cache
        k_buf, v_buf = cache.k_buffers[layer_id], cache.v_buffers[layer_id]
        k, v = self._k_ws.gather(k_buf, slots), self._v_ws.gather(v_buf, slots)
        if cache.format.quantized:  # stored rows to float rows (codes times their scale)
            return cache.format.decode(k), cache.format.decode(v)
        return k, v

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`rope`: (cos, signed sin) as `RotaryEmbedding.forward` returns them, when q and k
        arrive unrotated; None when they arrive rotated."""
        if rope is not None:
            if fb.mode is ForwardMode.DECODE and native_decode_supported(
                q, k, v, rope, fb.kv_cache.k_buffers[layer_id], fb.req_to_token
            ):
                return self._native_decode(q, k, v, layer_id, fb, rope)
            if fb.mode is ForwardMode.EXTEND:
                tail = self._one_token_tail(q, k, v, layer_id, fb, rope)
                if tail:
                    return self._extend_with_tail(q, k, v, layer_id, fb, rope, tail)
            joint = rope_and_write(q, k, v, rope, fb.kv_cache, layer_id, fb.out_cache_loc)
            if joint is not None:  # rotated, and K and V written
                q, k = joint
            else:
                q, k = rope_qk(q, k, rope)
                fb.kv_cache.write(layer_id, fb.out_cache_loc, k, v)
        else:
            fb.kv_cache.write(layer_id, fb.out_cache_loc, k, v)
        if fb.mode is ForwardMode.DECODE:
            return self._decode(q, layer_id, fb)
        if fb.mode is ForwardMode.VERIFY:
            return self._verify(q, layer_id, fb)
        return self._extend(q, layer_id, fb, new_kv=(k, v))

    def _one_token_tail(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> int:
        """How many of an extend step's last rows add one token each (a mixed step's decode
        rows, last by construction): each is one query over its cached keys, a decode row, so
        they take the native decode op together rather than one attention call each. 0 where
        fewer than two rows would, or the op does not take this step."""
        # the same for every layer of a pass: counted at its first layer (a layer id not above
        # the last one is a new pass, as for the decode plans)
        if fb is not self._tail_fb or layer_id <= self._tail_layer:
            self._tail_fb, self._tail = fb, one_token_tail(fb.extend_lens_cpu)
        self._tail_layer = layer_id
        tail = self._tail
        if tail < 2 or not native_decode_supported(
            q, k, v, rope, fb.kv_cache.k_buffers[layer_id], fb.req_to_token
        ):
            return 0
        return tail

    def _extend_with_tail(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        tail: int,
    ) -> torch.Tensor:
        """The leading rows as any extend step's, the last `tail` one-token rows (tokens) in
        one native call: RoPE, their K/V write and attention over each row's keys."""
        head = q.shape[0] - tail
        out_tail: torch.Tensor = torch.ops.stallfree.decode_attention(
            q[head:], k[head:], v[head:], *self._native_args(layer_id, fb, rope, head, tail)
        )
        if head == 0:
            return out_tail
        qh, kh = rope_qk(q[:head], k[:head], (rope[0][:head], rope[1][:head]))
        fb.kv_cache.write(layer_id, fb.out_cache_loc[:head], kh, v[:head])
        out_head = self._extend(qh, layer_id, fb, fb.batch_size - tail, (kh, v[:head]))
        return torch.cat([out_head, out_tail])

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        layer_id: int,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor | None:
        """A decode step's attention on the q/k/v projection's joint output [T, (H + 2 KVH)
        * D] (q and k unrotated), as [T, H * D]: one native call, the split and the reshapes
        taken as views inside it. None when the native op does not take this step; the caller
        then splits and calls `forward`."""
        width = num_heads + 2 * num_kv_heads
        if not (
            qkv.device.type == "cpu"
            and qkv.dim() == 2
            and qkv.shape[1] % width == 0
            and qkv.stride(1) == 1
            and not (torch.is_grad_enabled() and qkv.requires_grad)
            and self.takes_qkv(qkv.dtype, qkv.shape[1] // width, num_heads, num_kv_heads, fb, rope)
            and fb.kv_cache.k_buffers[layer_id].dtype in _NATIVE_CACHE_DTYPES
        ):
            return None
        out: torch.Tensor = torch.ops.stallfree.decode_attention_qkv(
            qkv, num_heads, num_kv_heads, *self._native_args(layer_id, fb, rope)
        )
        return out

    def takes_qkv(
        self,
        dtype: torch.dtype,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> bool:
        """Whether `decode_attention_qkv` takes a decode step whose joint projection is in
        `dtype` with heads of `dim` (the layer's cache dtype aside): the facts every layer of
        the step shares."""
        cos, signed_sin = rope
        return (
            fb.mode is ForwardMode.DECODE
            and dim % 16 == 0
            and num_heads % num_kv_heads == 0
            and dtype in _NATIVE_DTYPES
            and cos.dtype == signed_sin.dtype == dtype
            and cos.dim() == 3
            and cos.shape[1:] == (1, dim)
            and fb.req_to_token.dtype in (torch.int32, torch.int64)
            and cpu_kernels.available()
        )

    def loop_facts(self) -> tuple[object, ...]:
        """What the native loops' plans take from this backend besides its cache: the windows
        and the soft-cap. Part of their plans' cache key, since either can be set after the
        model is loaded, and the Python loop reads them on every call."""
        layers = None if self.layer_windows is None else tuple(self.layer_windows)
        return (self.sliding_window, layers, self.softcap)

    def loop_windows(self, layers: int, cache_dtype: torch.dtype) -> list[int | None] | None:
        """Each of `layers` layers' window (None: full attention) as the native decode ops
        take it, or None where a cache in `cache_dtype` is not one they read (`native_loop`
        hands them these, and the soft-cap, for every layer)."""
        if cache_dtype not in _NATIVE_CACHE_DTYPES:
            return None
        return [self._window(i) for i in range(layers)]

    def _native_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """RoPE, the K/V write at `out_cache_loc` and attention over every row's keys (or its
        window), in one call: no bucket plan, no gather copy."""
        out: torch.Tensor = torch.ops.stallfree.decode_attention(
            q, k, v, *self._native_args(layer_id, fb, rope)
        )
        return out

    def _native_args(
        self,
        layer_id: int,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        first_token: int = 0,
        rows: int | None = None,
    ) -> tuple[object, ...]:
        """The native decode ops' arguments after q/k/v: the RoPE tables, the layer's cache,
        the batch's slots and rows, and the layer's scale, soft-cap and window. With `rows`:
        the batch's last `rows` rows only, one token each from `first_token` on (an extend
        step's one-token tail)."""
        kv = fb.kv_cache
        cos, sin, locs = rope[0], rope[1], fb.out_cache_loc
        pool, lens = fb.req_pool_indices, fb.seq_lens
        if rows is not None:
            cos, sin, locs = cos[first_token:], sin[first_token:], locs[first_token:]
            pool, lens = pool[fb.batch_size - rows :], lens[fb.batch_size - rows :]
        return (
            cos,
            sin,
            kv.k_buffers[layer_id],
            kv.v_buffers[layer_id],
            locs,
            fb.req_to_token,
            pool,
            lens,
            self.scale,
            self.softcap,
            self._window(layer_id),
        )

    def _verify(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        """Every row's `k + 1` queries at once, padded to the longest row and to the widest
        key window the host allows (its upper bound). Query positions are the device's (each
        row's own length), so the causal mask hides the keys past them: positions a rejected
        draft wrote, or the window the host reserved but the device has not reached."""
        layout = fb.verify
        assert layout is not None
        width = int(fb.seq_lens_cpu.max())
        n_pos = layout.max_k + 1
        bsz = fb.batch_size
        device = q.device
        pos = torch.arange(width, device=device)
        slots = fb.req_to_token[:, :width][fb.req_pool_indices]  # [B, width]
        k, v = self._gather_kv(layer_id, fb, slots)  # [B, width, KVH, D]
        q_pad = q[layout.pad_index]  # [B, n_pos, H, D]
        q_pos = fb.positions[layout.pad_index]  # [B, n_pos]
        mask = pos[None, None, :] <= q_pos[:, :, None]
        window = self._window(layer_id)
        if window is not None:
            mask &= pos[None, None, :] > q_pos[:, :, None] - window
        out = attend_batched(
            q_pad.transpose(1, 2), k, v, mask[:, None], self.scale, self.softcap
        )  # [B, H, n_pos, D]
        flat = out.transpose(1, 2).reshape(bsz * n_pos, *q.shape[1:])
        return flat[layout.flat_pos]

    def _extend(
        self,
        q: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        rows: int | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention of the first `rows` rows (all by default), whose tokens q holds. `new_kv`:
        those tokens' keys and values as written; a row with no prefix attends over them
        straight where the cache stores them unchanged (its dtype, unquantized), rather than
        over a gathered copy of the same values."""
        outs = []
        start = 0
        cache = fb.kv_cache
        if new_kv is not None and (
            cache.format.quantized or cache.k_buffers[layer_id].dtype != new_kv[0].dtype
        ):
            new_kv = None
        for i in range(fb.batch_size if rows is None else rows):
            n, prefix = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i]
            seq = prefix + n
            window = self._window(layer_id)
            if window is not None and seq <= window:
                window = None  # no query reaches past its window
            chunk = q[start : start + n]
            if prefix == 0 and window is None and new_kv is not None:
                k, v = new_kv[0][start : start + n], new_kv[1][start : start + n]
                outs.append(attend_prompt(chunk, k, v, 0, scale=self.scale, softcap=self.softcap))
                start += n
                continue
            # keys before the first query's window are never seen
            first = 0 if window is None else max(0, prefix + 1 - window)
            row = int(fb.req_pool_indices_cpu[i])
            slots = fb.req_to_token[row, first:seq]
            k, v = self._gather_kv(layer_id, fb, slots)
            outs.append(attend_prompt(chunk, k, v, prefix, first, window, self.scale, self.softcap))
            start += n
        if len(outs) == 1:
            return outs[0]
        return torch.cat(outs) if outs else q.new_empty(q.shape)

    def _decode(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        if fb is not self._plan_fb or layer_id <= self._plan_layer:
            self._plans = {}
            self._plan_fb = fb
        self._plan_layer = layer_id
        window = self._window(layer_id)
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = self._decode_plan(fb, q.device, window)
        scale, cap = self.scale, self.softcap
        # Each bucket: B independent single-query problems, [n, H, 1, D] against [n, KVH, L, D].
        if len(plan) == 1 and plan[0].index is None:
            b = plan[0]
            k, v = self._gather_kv(layer_id, fb, b.slots)
            out1 = _sdpa(
                q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), b.mask, False, scale, cap
            )
            return out1[:, :, 0, :]
        out = torch.empty_like(q)
        for b in plan:
            assert b.index is not None
            k, v = self._gather_kv(layer_id, fb, b.slots)
            qb = q[b.index][:, :, None, :]
            part = _sdpa(qb, k.transpose(1, 2), v.transpose(1, 2), b.mask, False, scale, cap)
            out.index_copy_(0, b.index, part[:, :, 0, :])
        return out

    def _decode_plan(
        self, fb: ForwardBatch, device: torch.device, window: int | None
    ) -> list[_Bucket]:
        """Length buckets from host lengths; slots and masks by device ops on the batch rows."""
        lens = fb.seq_lens_cpu.tolist()  # host copy: the length after this step
        if window is not None and max(lens, default=0) <= window:
            window = None  # every row sees all its keys
        widths = lens if window is None else [min(n, window) for n in lens]
        k_buf = fb.kv_cache.k_buffers[0]
        kv_elems = k_buf.numel() // max(1, k_buf.shape[0])  # per token
        groups = plan_buckets(widths, BUCKET_PAD_RATIO, BUCKET_MERGE_ELEMS // max(1, kv_elems))
        index = None
        if len(groups) > 1:
            index = _to_device([i for g in groups for i in g], device)
        buckets = []
        start = 0
        for g in groups:
            width = widths[g[0]]
            if index is None:
                idx, rows, seq_lens = None, fb.req_pool_indices, fb.seq_lens
            else:
                idx = index[start : start + len(g)]
                rows, seq_lens = fb.req_pool_indices[idx], fb.seq_lens[idx]
            start += len(g)
            pos = torch.arange(width, device=device)[None, :]
            if window is None:
                slots = fb.req_to_token[rows, :width]
                keys = seq_lens[:, None]  # valid keys per row: positions below the length
            else:
                # the window [first, length) of each row, padded at its end
                first = (seq_lens - window).clamp_(min=0)[:, None]
                slots = fb.req_to_token[rows[:, None], first + pos]
                keys = seq_lens[:, None] - first
            padded = any(widths[i] != width for i in g)
            mask = (pos < keys)[:, None, None, :] if padded else None
            buckets.append(_Bucket(idx, slots, mask))
        return buckets


def causal_mask(
    prefix: int,
    seq: int,
    device: torch.device,
    sliding_window: int | None = None,
    first_key: int = 0,
) -> torch.Tensor:
    """[seq - prefix, seq - first_key]: query at position prefix + i sees keys up to prefix + i.

    Columns are key positions first_key..seq - 1; with a window, only the last `sliding_window`.
    """
    q_pos = torch.arange(prefix, seq, device=device)[:, None]
    k_pos = torch.arange(first_key, seq, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One request: q [n, H, D], k/v [seq, KVH, D], mask [n, seq] -> [n, H, D].

    `mask=None` is plain causal attention with no prefix (n == seq), without building a mask.
    """
    # a batch dim of 1 lets SDPA take its fused kernel (3-D inputs take the slow path)
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    out = _sdpa(q4, k4, v4, mask, mask is None, scale, softcap)
    return out[0].transpose(0, 1)


def attend_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, H, n, D], k/v [B, L, KVH, D], mask broadcastable to [B, H, n, L] -> [B, H, n, D]."""
    return _sdpa(q, k.transpose(-3, -2), v.transpose(-3, -2), mask, False, scale, softcap)
