"""GGUF quantized blocks read as integer codes and scales, for weights kept quantized.

Block layouts are llama.cpp's (ggml-common.h); each decoder returns the weight in the form
the int4 / int8 kernels take (quant.py), and `tests/model/test_quant.py` checks every one
against the `gguf` library's own dequantisation.

- Q4_0 (18 bytes / 32): fp16 `d`, 16 bytes of nibbles (low: elements 0-15, high: 16-31);
  `w = d * (q - 8)`: scale `d`, zero 0.
- Q4_1 (20 bytes / 32): fp16 `d`, fp16 `m`, nibbles as Q4_0; `w = d * q + m`: scale `d`,
  zero `m + 8 d`.
- Q4_K (144 bytes / 256): fp16 `d`, fp16 `dmin`, 12 bytes of 6-bit sub-block scales and mins
  (8 sub-blocks of 32), then per 64 elements 32 bytes (low nibbles the first 32, high the
  next); `w = d * sc_j * q - dmin * m_j`: scale `d sc_j`, zero `8 d sc_j - dmin m_j`.
- Q8_0 (34 bytes / 32): fp16 `d`, 32 int8; `w = d * q`, kept as it is (`BlockQuant8`).
- Q5_0, Q5_1, Q5_K, Q6_K (5 and 6 bits): where the native kernels run, decoded and
  re-quantized to 8-bit codes with a float16 scale per block of 32 (`BlockQuant8`: at most
  half a step of 8 bits off the file's values, against the 5-6 bits the file kept);
  elsewhere they load dense, as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stallfree.runtime.model import cpu_kernels
from stallfree.runtime.model.quant import (
    BlockQuant8,
    GroupQuant,
    quantize_int8_blocks,
)

PACKED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
# kept as 8-bit blocks where the native kernels take them (their block-scaled int8 product)
REQUANTIZED_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")


def _fp16(raw: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block ([blocks, bytes]), as float32: one pass."""
    words = raw.view(np.float16)  # the blocks' sizes are even, so each row is whole words
    return words[:, start // 2].astype(np.float32)


def _k4_pairs(chunks: np.ndarray) -> np.ndarray:
    """Q4_K's [blocks, 4, 32] bytes (per 64 elements: elements 0-31 in the low nibbles, 32-63
    in the high) as nibble pairs of its 8 sub-blocks of 32: [blocks, 8, 16]."""
    low, high = chunks & 0x0F, chunks >> 4
    out = np.empty((chunks.shape[0], 4, 2, 16), np.uint8)
    out[:, :, 0] = low[:, :, :16] | (low[:, :, 16:] << 4)
    out[:, :, 1] = high[:, :, :16] | (high[:, :, 16:] << 4)
    return out.reshape(-1, 8, 16)


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[blocks, 12] -> the 8 six-bit scales and mins of each Q4_K super-block."""
    p = packed.astype(np.uint16)
    sc = np.empty((p.shape[0], 8), np.uint16)
    mn = np.empty((p.shape[0], 8), np.uint16)
    sc[:, :4] = p[:, 0:4] & 63
    mn[:, :4] = p[:, 4:8] & 63
    sc[:, 4:] = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _group(
    rows: int, cols: int, pairs: np.ndarray, scale: np.ndarray, zero: np.ndarray
) -> GroupQuant:
    """`pairs`: [blocks, 16] nibble pairs (element j low, j + 16 high). Q4_0's and Q4_1's code
    bytes are already these, so they are copied once here, never unpacked."""
    return GroupQuant(
        torch.from_numpy(np.ascontiguousarray(pairs.reshape(rows, cols // 32, 16))),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, cols // 32))),
        torch.from_numpy(np.ascontiguousarray(zero.reshape(rows, cols // 32))),
    )


def _q8_0(raw: np.ndarray, rows: int, cols: int) -> BlockQuant8:
    """Q8_0 as stored: each block's float16 scale and its 32 codes."""
    b = np.ascontiguousarray(raw).reshape(rows, cols // 32, 34)
    scale = b[:, :, :2].copy().view(np.float16)[:, :, 0]
    q = b[:, :, 2:].copy().view(np.int8).reshape(rows, cols)
    return BlockQuant8(torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(scale)))


def _requantized(raw: np.ndarray, qtype: Any, rows: int, cols: int) -> BlockQuant8:
    """A 5- or 6-bit type decoded by the gguf library and re-quantized to 8-bit blocks of 32,
    a slice of rows at a time (the float32 copy of the whole weight is never made)."""
    from gguf.quants import dequantize

    q = torch.empty((rows, cols), dtype=torch.int8)
    scale = torch.empty((rows, cols // 32), dtype=torch.float16)
    step = max(1, (1 << 20) // max(cols, 1))
    for start in range(0, rows, step):
        part = np.asarray(dequantize(raw[start : start + step], qtype), dtype=np.float32)
        blocks = quantize_int8_blocks(torch.from_numpy(part.reshape(-1, cols)))
        q[start : start + step] = blocks.q
        scale[start : start + step] = blocks.scale
    return BlockQuant8(q, scale)


def decode_blocks(
    raw: np.ndarray, type_name: str, rows: int, cols: int
) -> GroupQuant | BlockQuant8:
    """One tensor's raw bytes ([rows, bytes per row]) as codes and scales."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if type_name == "Q4_0":
        b = raw.reshape(-1, 18)
        d = _fp16(b, 0)
        return _group(rows, cols, b[:, 2:], d, np.zeros_like(d))
    if type_name == "Q4_1":
        b = raw.reshape(-1, 20)
        d, m = _fp16(b, 0), _fp16(b, 2)
        return _group(rows, cols, b[:, 4:], d, m + 8 * d)
    if type_name == "Q4_K":
        b = raw.reshape(-1, 144)
        d, dmin = _fp16(b, 0), _fp16(b, 2)
        sc, mn = _k4_scales(b[:, 4:16])
        # 4 chunks of 32 bytes, each 2 sub-blocks: low nibbles, then high
        pairs = _k4_pairs(b[:, 16:].reshape(-1, 4, 32))
        scale = d[:, None] * sc
        zero = 8 * scale - dmin[:, None] * mn
        return _group(rows, cols, pairs, scale, zero)
    if type_name == "Q8_0":
        return _q8_0(raw.reshape(rows, -1), rows, cols)
    raise ValueError(f"GGUF type {type_name} is not kept quantized")


def packed_weight(tensor: Any) -> GroupQuant | BlockQuant8 | None:
    """A GGUF reader tensor as a quantized weight, or None for a type kept dense."""
    name = tensor.tensor_type.name
    if len(tensor.shape) != 2:
        return None
    cols, rows = (int(d) for d in tensor.shape)
    if name in REQUANTIZED_TYPES and cols % 32 == 0 and cpu_kernels.available():
        return _requantized(tensor.data, tensor.tensor_type, rows, cols)
    if name not in PACKED_TYPES:
        return None
    return decode_blocks(tensor.data, name, rows, cols)
