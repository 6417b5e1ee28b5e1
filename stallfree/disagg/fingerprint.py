"""What a prefill and a decode server check before they move any KV: the same model (its
tensors' names and shapes and a hash of a few of them), the same KV dtype, page size and layout,
and tensor-parallel sizes that map. A mismatch is refused with a message that names it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from stallfree.overlap.process_stream import encode_tensor
from stallfree.runtime.core import EngineCore

# the KV layout both sides must share: per layer, K and V buffers [slots, kv_heads, head_dim]
# in pages of `page_size` consecutive slots
KV_LAYOUT = "per-layer-kv/slots-heads-dim/v1"
# bytes hashed from each sampled tensor, and how many tensors are sampled
SAMPLE_BYTES = 1 << 16
SAMPLED_TENSORS = 4


class HandshakeError(RuntimeError):
    """The two servers cannot work together; the message names what differs."""


class Fingerprint(BaseModel):
    model_digest: str
    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str
    page_size: int
    kv_layout: str
    tp_size: int
    quantization: str

    def check_decode(self, decode: Fingerprint) -> None:
        """Raise `HandshakeError` unless a decode server with `decode` can take this
        prefill's KV."""
        differ = [
            f"{label} differs: prefill {mine}, decode {theirs}"
            for label, mine, theirs in (
                ("model weights (digest)", self.model_digest[:16], decode.model_digest[:16]),
                ("layers", self.num_layers, decode.num_layers),
                ("KV heads", self.num_kv_heads, decode.num_kv_heads),
                ("head dim", self.head_dim, decode.head_dim),
                ("vocabulary", self.vocab_size, decode.vocab_size),
                ("KV dtype", self.kv_dtype, decode.kv_dtype),
                ("page size", self.page_size, decode.page_size),
                ("KV layout", self.kv_layout, decode.kv_layout),
            )
            if mine != theirs
        ]
        if self.tp_size != 1:
            differ.append(f"prefill tensor-parallel size {self.tp_size} (prefill must be 1)")
        if decode.tp_size > 1 and not (
            decode.num_kv_heads % decode.tp_size == 0 or decode.tp_size % decode.num_kv_heads == 0
        ):
            differ.append(
                f"decode tensor-parallel size {decode.tp_size} does not split "
                f"{decode.num_kv_heads} KV heads"
            )
        if differ:
            raise HandshakeError("; ".join(differ))


def fingerprint_of(core: EngineCore) -> Fingerprint:
    config, arch = core.config, core.arch
    return Fingerprint(
        model_digest=model_digest(config.model.path, config.model.seed),
        model_name=Path(config.model.path).name,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        kv_dtype=kv_dtype_name(core),
        page_size=core.ctx.allocator.page_size,
        kv_layout=KV_LAYOUT,
        tp_size=config.parallel.tp_size,
        quantization=config.model.quantization,
    )


def kv_dtype_name(core: EngineCore) -> str:
    """The KV cache's dtype as the handshake compares it: the stored dtype (`bfloat16`), or
    the quantized format (`int8`, `fp8_e4m3`, `fp8_e5m2`), whose rows carry their scales."""
    fmt = core.ctx.kv_cache.format
    return fmt.name if fmt.quantized else str(fmt.storage).removeprefix("torch.")


def model_digest(path: str, seed: int) -> str:
    """A digest of the checkpoint on disk: every tensor's name, dtype and shape, and the first
    bytes of a few of them. A preset (seeded random weights) is its name and seed."""
    h = hashlib.sha256()
    p = Path(path)
    if p.is_dir():
        _digest_safetensors(sorted(p.glob("*.safetensors")), h)
    elif p.is_file() and p.suffix.lower() == ".gguf":
        _digest_gguf(p, h)
    else:
        h.update(f"preset:{path}:{seed}".encode())
    return h.hexdigest()


def _digest_safetensors(files: list[Path], h: Any) -> None:
    from safetensors import safe_open

    names: list[tuple[Path, str]] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                sl = st.get_slice(name)
                h.update(f"{name}:{sl.get_dtype()}:{list(sl.get_shape())};".encode())
                names.append((f, name))
    step = max(1, len(names) // SAMPLED_TENSORS)
    for f, name in names[::step][:SAMPLED_TENSORS]:
        with safe_open(str(f), framework="pt") as st:
            t = st.get_tensor(name).reshape(-1)
            h.update(encode_tensor(t[: SAMPLE_BYTES // max(1, t.element_size())].clone())[2])


def _digest_gguf(path: Path, h: Any) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = sorted(reader.tensors, key=lambda t: t.name)
    for t in tensors:
        h.update(f"{t.name}:{t.tensor_type}:{list(t.shape)};".encode())
    step = max(1, len(tensors) // SAMPLED_TENSORS)
    for t in tensors[::step][:SAMPLED_TENSORS]:
        h.update(bytes(t.data.reshape(-1).view("uint8")[:SAMPLE_BYTES]))
