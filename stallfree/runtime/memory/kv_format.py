"""How the KV cache stores a row (one token's K or V for one KV head): `--kv-cache-dtype`.

- `auto`: the row as the model computes it, in the weights' dtype.
- `int8`, `fp8_e4m3` (`fp8`), `fp8_e5m2`: one byte per element, the row divided by its own
  float32 scale `s = max|x| / M` (M the codes' largest value: 127, 448 or 57344) and rounded
  to nearest even (int8 clamped to +-127, fp8 to +-M), with `s` kept in the row's last 4 bytes,
  as llama.cpp's `q8_0` keeps a block's scale beside its codes. The scale puts each row's
  largest value on the format's largest code (stored exactly) and keeps small rows out of fp8's
  subnormals. A stored row is `head_dim + 4` bytes, so everything that moves rows (prefix
  sharing, the HiSparse host pool, disaggregation, worker imports) moves the scale with them.

Stored rows are `[..., row_width]` tensors of `storage`; `encode` makes them from float rows,
`decode` gives float rows back. The native decode op (csrc/attention.cpp) encodes the same way,
bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's spellings; `fp8` is `fp8_e4m3`
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
_ALIASES = {"fp8": "fp8_e4m3"}
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# the largest code of each quantized format: a row's scale maps its largest |x| onto it
CODE_MAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
SCALE_BYTES = 4


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One storage format of KV rows; `compute` is the dtype rows decode to by default."""

    name: str  # auto, fp8_e4m3, fp8_e5m2, int8
    storage: torch.dtype
    compute: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def scaled(self) -> bool:
        """Whether each row carries its own float32 scale after its codes (every quantized
        format does)."""
        return self.name in CODE_MAX

    def row_width(self, head_dim: int) -> int:
        """Elements of `storage` per stored row."""
        return head_dim + SCALE_BYTES if self.scaled else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.storage.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Float rows `[..., head_dim]` -> stored rows `[..., row_width]`."""
        if self.name == "auto":
            return x.to(self.storage)
        limit = CODE_MAX[self.name]
        x32 = x.float()
        scale = x32.abs().amax(dim=-1, keepdim=True) / limit
        codes = torch.where(scale > 0, x32 / scale, 0.0)
        if self.name == "int8":
            codes.round_()  # fp8's conversion rounds to nearest even by itself
        codes.clamp_(-limit, limit)
        dim = x.shape[-1]
        out = torch.empty((*x.shape[:-1], dim + SCALE_BYTES), dtype=self.storage, device=x.device)
        out[..., :dim] = codes.to(self.storage)
        out[..., dim:] = scale.view(self.storage)
        return out

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows `[..., row_width]` -> float rows `[..., head_dim]` in `dtype`."""
        dtype = self.compute if dtype is None else dtype
        if self.name == "auto":
            return rows.to(dtype)
        dim = rows.shape[-1] - SCALE_BYTES
        scale = rows[..., dim:].contiguous().view(torch.float32)
        return (rows[..., :dim].float() * scale).to(dtype)

    def round_trip(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`x` as the cache gives it back."""
        return self.decode(self.encode(x), dtype)


def kv_format(kv_cache_dtype: str, dtype: torch.dtype) -> KVFormat:
    """The format for `--kv-cache-dtype`, with `dtype` the weights' (what `auto` stores)."""
    name = _ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name == "auto":
        return KVFormat("auto", dtype, dtype)
    if name == "int8":
        return KVFormat("int8", torch.int8, dtype)
    if name in _FP8:
        return KVFormat(name, _FP8[name], dtype)
    raise ValueError(
        f"kv_cache_dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
    )
