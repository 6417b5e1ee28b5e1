"""Shapes of the native CPU ops (cpu_kernels.py) for torch.compile: the ops are traced as
calls, never into, so each needs only its output's shape and dtype (a fake implementation).
`FAKES` maps each op's name to its fake; `cpu_kernels` registers them once the library loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _rows_out(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _rows_out(x, weight.shape[0])


def _linear_compact(
    x: torch.Tensor,
    weight: torch.Tensor,
    codes: torch.Tensor,
    tables: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return _rows_out(x, weight.shape[0])


def _compact_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's compact form: 1.5 bytes a value, and 16 table bytes a row."""
    n, k = weight.shape
    return weight.new_empty((n, k + k // 2), dtype=torch.uint8), weight.new_empty(
        (n, 16), dtype=torch.uint8
    )


def _uncompact_bf16(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    return codes.new_empty((codes.shape[0], codes.shape[1] * 2 // 3), dtype=torch.bfloat16)


def _decompact_bf16(
    codes: torch.Tensor, tables: torch.Tensor, weight: torch.Tensor, start: int, out: torch.Tensor
) -> None:
    return None


def _linear_group(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return _rows_out(x, sum(w.shape[0] for w in weights))


def _q8_rows(qweight: torch.Tensor) -> int:
    """An int8 weight's output rows: row-major [out, in], or 16 a group in the lanes (3-D)."""
    return qweight.shape[0] * (16 if qweight.dim() == 3 else 1)


def _linear_q8(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _rows_out(x, _q8_rows(qweight))


def _linear_q8_blocks(
    x: torch.Tensor, qweight: torch.Tensor, bscale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _rows_out(x, _q8_rows(qweight))


def _prompt_out(x: torch.Tensor, n: int, silu: bool, pack: bool, rows: int) -> torch.Tensor:
    """A prompt product's output: rows of its width, or (`pack`) the next product's packed
    activations; `x` is rows, or (int32) a product's packed output of `rows` rows."""
    width = n // (2 if silu else 1)
    m = rows if x.dtype == torch.int32 else x.numel() // max(x.shape[-1], 1)
    if pack:
        return x.new_empty((width // 32, (m + 15) // 16, 16, 16), dtype=torch.int32)
    if x.dtype == torch.int32:
        return x.new_empty((m, width), dtype=torch.bfloat16)
    return _rows_out(x, width)


def _linear_q8_prompt(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor | None,
    bscale: torch.Tensor | None,
    bias: torch.Tensor | None,
    silu: bool = False,
    pack: bool = False,
    rows: int = 0,
) -> torch.Tensor:
    return _prompt_out(x, qweight.shape[0], silu, pack, rows)


def _linear_q4_prompt(
    x: torch.Tensor,
    codes: torch.Tensor,
    gscale: torch.Tensor,
    goffset: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool = False,
    pack: bool = False,
    rows: int = 0,
) -> torch.Tensor:
    return _prompt_out(x, codes.shape[0], silu, pack, rows)


def _linear_bf16_prompt(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool = False,
    pack: bool = False,
    rows: int = 0,
) -> torch.Tensor:
    return _prompt_out(x, weight.shape[0], silu, pack, rows)


def _dequantize_q8(
    qweight: torch.Tensor,
    scale: torch.Tensor | None,
    bscale: torch.Tensor | None,
    out: torch.Tensor,
    bf16_values: bool = False,
) -> None:
    return None


def _dequantize_q4(
    codes: torch.Tensor,
    gscale: torch.Tensor,
    goffset: torch.Tensor,
    out: torch.Tensor,
    bf16_values: bool = False,
) -> None:
    return None


def _linear_q4(
    x: torch.Tensor,
    codes: torch.Tensor,
    gscale: torch.Tensor,
    goffset: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    # nibble pairs [out, in / 32, 16], or 16 rows in the lanes [out / 16, in / 32, 4, 64]
    return _rows_out(x, codes.shape[0] * (16 if codes.dim() == 4 else 1))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def _add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _rows_out(gate_up, gate_up.shape[-1] // 2)


def _decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cos: torch.Tensor | None,
    signed_sin: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def _decode_attention_qkv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor | None,
    signed_sin: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    return qkv.new_empty((qkv.shape[0], num_heads * dim))


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int = 0,
    first: int = 0,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _rope_write(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    heads: int,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    return x.new_empty(x.shape)


def _decode_layers(h: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's output and the residual stream, each the shape of `h` (a decode
    step's `decode_layers` and a prompt's `prefill_layers` alike)."""
    return h.new_empty(h.shape), h.new_empty(h.shape)


FAKES: dict[str, Callable[..., Any]] = {
    "linear": _linear,
    "linear_group": _linear_group,
    "linear_compact": _linear_compact,
    "compact_bf16": _compact_bf16,
    "uncompact_bf16": _uncompact_bf16,
    "decompact_bf16": _decompact_bf16,
    "linear_q8": _linear_q8,
    "linear_q8_blocks": _linear_q8_blocks,
    "linear_q8_prompt": _linear_q8_prompt,
    "linear_q4_prompt": _linear_q4_prompt,
    "linear_bf16_prompt": _linear_bf16_prompt,
    "dequantize_q8": _dequantize_q8,
    "dequantize_q4": _dequantize_q4,
    "linear_q4": _linear_q4,
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "silu_mul": _silu_mul,
    "decode_attention": _decode_attention,
    "decode_attention_qkv": _decode_attention_qkv,
    "prefill_attention": _prefill_attention,
    "decode_layers": _decode_layers,
    "prefill_layers": _decode_layers,
    "rope": _rope,
    "rope_write": _rope_write,
}
