"""GGUF checkpoints (llama, qwen2, qwen3, phi3, gemma2, gemma3): config, dequantised weights
and tokenizer from one file.

Weights are dequantised to float32 through the `gguf` library (`pip install 'stallfree[gguf]'`)
and renamed to the Hugging Face names `LlamaForCausalLM` uses (each family's names are in
gguf_families.py; Phi-3's fused tensors are split by fused_weights.py). llama.cpp's converter
reorders the rows of each Q and K head of a Llama file for its interleaved RoPE; `_unpermute`
restores the Hugging Face order, so the loaded model computes what transformers computes.

The tokenizer is rebuilt from the `tokenizer.ggml.*` metadata as a `tokenizers.Tokenizer`
(GPT-2 style byte-level BPE, as SmolLM2, Llama 3 and Qwen2 files describe it; or sentencepiece
BPE with byte fallback, as Llama 2, TinyLlama and Mistral files do).

The file is parsed by `gguf.GGUFReader` once; what loading derives from it (metadata, tokenizer
JSON, tensor table) is cached on disk by gguf_cache.py, and the tensors are read from a memory
map of the file at the table's offsets, so a later start builds no reader.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from stallfree.runtime.model import gguf_cache
from stallfree.runtime.model.arch import GEMMA_ARCHITECTURES, ModelArchConfig, ModelLoadError
from stallfree.runtime.model.fused_weights import is_fused, split_fused
from stallfree.runtime.model.gguf_cache import GGUFIndex, GGUFTensor, TokenizerEntry
from stallfree.runtime.model.gguf_families import (
    GGUF_FAMILIES,
    GLOBAL_TENSORS,
    ROPE_FACTOR_TENSORS,
    GGUFFamily,
    rope_scaling,
    with_gemma,
    with_longrope,
)
from stallfree.runtime.model.gguf_moe import (
    gguf_moe_config,
    is_moe_tensor,
    moe_architecture,
    moe_tensors,
    routed_layers,
)

if TYPE_CHECKING:
    from stallfree.runtime.model.quant import QuantizedWeight
    from stallfree.runtime.text.tokenizer import HFTokenizer

_INSTALL_HINT = "pip install 'stallfree[gguf]'"

# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# pre-tokenizer splits for the `tokenizer.ggml.pre` values whose merges were not learned on
# GPT-2's own split (which ByteLevel applies when none is given)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def _gguf_module(error: type[Exception]) -> Any:
    try:
        import gguf
    except ImportError as e:
        raise error(f"loading a .gguf file needs the gguf package: {_INSTALL_HINT}") from e
    return gguf


@dataclass(slots=True)
class GGUFCheckpoint:
    arch: ModelArchConfig
    # HF names, on the host: float32, or with keep_quantized a linear weight's blocks
    tensors: dict[str, torch.Tensor | QuantizedWeight]
    name: str


class _Metadata:
    """The key/value fields of one GGUF file (gguf_cache.py's index: a large array, which only
    the tokenizer reads, is there as its length)."""

    def __init__(
        self, fields: dict[str, Any], lengths: dict[str, int], path: Path, error: type[Exception]
    ) -> None:
        self._fields = fields
        self._lengths = lengths
        self._path = path
        self._error = error

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._fields:
            return self._fields[key]
        if key in self._lengths:
            raise self._error(f"{self._path}: GGUF array {key!r} is not kept in the index")
        return default

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise self._error(f"{self._path}: GGUF metadata has no {key!r}")
        return value

    def length(self, key: str) -> int:
        """The number of elements of an array field."""
        if key in self._lengths:
            return self._lengths[key]
        return len(self.require(key))


def _open(path: Path, error: type[Exception]) -> tuple[GGUFIndex, _Metadata]:
    _gguf_module(error)
    if not path.is_file():
        raise error(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    try:
        index = _cached_index(
            str(path.resolve()), stat.st_mtime_ns, stat.st_size, str(gguf_cache.cache_dir())
        )
    except Exception as e:
        raise error(f"cannot read GGUF file {str(path)!r}: {e}") from e
    return index, _Metadata(index.fields, index.array_lengths, path, error)


@functools.lru_cache(maxsize=1)
def _cached_index(path: str, mtime_ns: int, size: int, cache_dir: str) -> GGUFIndex:
    """The file's index from the cache, or parsed and cached. The model and the tokenizer are
    loaded one after the other from the same file, so the last index is also kept here."""
    file = Path(path)
    key = gguf_cache.file_key(file)
    index = gguf_cache.load_index(key)
    if index is None:
        index = _parse(file)
        gguf_cache.store_index(key, index)
    return index


def _parse(path: Path) -> GGUFIndex:
    """The index of a file, from `GGUFReader` (seconds for a large vocabulary)."""
    from gguf import GGUFReader

    from stallfree.runtime.text.tokenizer import TokenizerLoadError

    with _gc_paused():
        reader = GGUFReader(str(path))
        fields = gguf_cache.reader_fields(reader)
        try:
            tokenizer = _tokenizer_entry(_Metadata(fields, {}, path, TokenizerLoadError), path)
        except Exception:  # loading the tokenizer parses the file again and raises the reason
            tokenizer = None
        return gguf_cache.index_from_reader(reader, fields, tokenizer)


def _parsed_metadata(path: Path, error: type[Exception]) -> _Metadata:
    from gguf import GGUFReader

    with _gc_paused():
        fields = gguf_cache.reader_fields(GGUFReader(str(path)))
    return _Metadata(fields, {}, path, error)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """NOTE: the reader allocates a numpy view per token and merge (about a million objects,
    none in a cycle); the cyclic collector's passes over them were a third of SmolLM2's parse,
    more in a server process that holds more objects."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---------------------------------------------------------------------------- model


def read_gguf_checkpoint(
    path: str | Path, keep_quantized: bool = False, dtype: torch.dtype | None = None
) -> GGUFCheckpoint:
    """The architecture and the tensors (HF names) of a GGUF, dequantised to float32, or to
    `dtype` one tensor at a time (the whole model in float32 is never held: a BF16 file's
    135M parameters were 538 MB of float32 beside their bf16 copies at the load's peak).

    With `keep_quantized`, the linear weights (and a tied embedding, which is the output
    matrix) of the types gguf_blocks.py reads come as their codes and scales instead.
    """
    path = Path(path)
    index, meta = _open(path, ModelLoadError)
    file_tensors = gguf_cache.map_tensors(path, index)
    arch = _arch(path, meta, file_tensors)
    family = GGUF_FAMILIES[str(meta.require("general.architecture"))]
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in file_tensors:
        if tensor.name in ROPE_FACTOR_TENSORS:  # in the config (_arch)
            continue
        tensors.update(_entries(tensor, arch, family, keep_quantized, dtype))
        gguf_cache.drop_pages(tensor)  # copied out: its file pages leave the resident set
    name = str(meta.get("general.name") or path.stem)
    return GGUFCheckpoint(arch=arch, tensors=tensors, name=name)


def _entries(
    tensor: GGUFTensor,
    arch: ModelArchConfig,
    family: GGUFFamily,
    keep_quantized: bool,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """One file tensor as the checkpoint's entries (HF names): dequantised (to `dtype` where
    given) or, kept quantized, its codes and scales; a fused tensor split into its parts."""
    from stallfree.runtime.model.gguf_blocks import packed_weight

    if is_moe_tensor(tensor.name):  # experts, routers (gguf_moe.py): always dense
        experts = moe_tensors(tensor.name, _dequantize(tensor), arch)
        return {k: v if dtype is None else v.to(dtype) for k, v in experts.items()}
    hf_name = _hf_name(tensor.name, family)
    if family.permute_qk and tensor.name.endswith("attn_q.weight"):
        tensor = _unpermute_tensor(tensor, arch.num_heads)
    elif family.permute_qk and tensor.name.endswith("attn_k.weight"):
        tensor = _unpermute_tensor(tensor, arch.num_kv_heads)
    linear = hf_name.endswith("_proj.weight") or hf_name == "lm_head.weight"
    linear = linear or (hf_name == "model.embed_tokens.weight" and arch.tie_word_embeddings)
    packed = packed_weight(tensor) if keep_quantized and linear else None
    weight: torch.Tensor | QuantizedWeight = packed if packed is not None else _dequantize(tensor)
    if family.norm_shift and hf_name.endswith("norm.weight"):
        weight = cast(torch.Tensor, weight) - 1.0  # llama.cpp stored Gemma's 1 + w
    if dtype is not None and isinstance(weight, torch.Tensor):
        weight = weight.to(dtype)
    if is_fused(hf_name, arch):
        return dict(split_fused(hf_name, weight, arch))
    return {hf_name: weight}


def read_gguf_arch(path: str | Path) -> ModelArchConfig:
    """The architecture alone: the metadata and tensor names (and longrope's factors)."""
    path = Path(path)
    index, meta = _open(path, ModelLoadError)
    return _arch(path, meta, gguf_cache.map_tensors(path, index))


def _arch(path: Path, meta: _Metadata, tensors: list[GGUFTensor]) -> ModelArchConfig:
    names = [t.name for t in tensors]
    arch = gguf_arch_config(
        meta, path, has_output="output.weight" in names, routed=routed_layers(names)
    )
    factors = {
        ROPE_FACTOR_TENSORS[t.name]: _dequantize(t).flatten().tolist()
        for t in tensors
        if t.name in ROPE_FACTOR_TENSORS
    }
    return with_longrope(arch, meta, factors, path) if factors else arch


def gguf_arch_config(
    meta: _Metadata, path: Path, *, has_output: bool, routed: set[int] | None = None
) -> ModelArchConfig:
    """The file's architecture; `routed`: the layers with an MoE router (gguf_moe.py)."""
    family = meta.require("general.architecture")
    if family not in GGUF_FAMILIES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {family!r}; "
            f"supported: {', '.join(GGUF_FAMILIES)}"
        )
    spec = GGUF_FAMILIES[family]

    def key(name: str) -> Any:
        return meta.require(f"{family}.{name}")

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{family}.attention.key_length") or hidden // heads)
    rope_dim = meta.get(f"{family}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim})")
    n_tokens = meta.length("tokenizer.ggml.tokens")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [
        int(i)
        for i in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
        if i is not None
    ]
    window = int(meta.get(f"{family}.attention.sliding_window") or 0) if spec.sliding_window else 0
    layers = int(key("block_count"))
    moe = gguf_moe_config(meta, family, routed or set(), layers)
    arch = ModelArchConfig(
        # the token list is padded to the embedding's rows ([PAD<i>] entries)
        vocab_size=int(meta.get(f"{family}.vocab_size") or n_tokens),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{family}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{family}.rope.freq_base") or 10000.0),
        rope_scaling=rope_scaling(meta, family, path),
        max_position_embeddings=int(meta.get(f"{family}.context_length") or 2048),
        tie_word_embeddings=not has_output,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        architecture=moe_architecture(moe, spec.architecture),
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        sliding_window=window or None,
        moe=moe,
    )
    return with_gemma(arch, meta, family) if spec.architecture in GEMMA_ARCHITECTURES else arch


def _hf_name(gguf_name: str, family: GGUFFamily) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    if gguf_name == "rope_freqs.weight":
        # Llama 3.1+ frequency factors: ModelArchConfig cannot express them yet
        raise ModelLoadError("GGUF rope_freqs (Llama 3.1 rope scaling) is not supported yet")
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in family.layer_tensors:
        return f"model.layers.{int(parts[1])}.{family.layer_tensors[parts[2]]}"
    raise ModelLoadError(f"unexpected tensor in GGUF checkpoint: {gguf_name}")


def _dequantize(tensor: Any) -> torch.Tensor:
    """Float32 in the row-major shape torch wants (GGUF lists dimensions innermost first)."""
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name}: cannot dequantise {tensor.tensor_type.name}: {e}"
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = np.asarray(array, dtype=np.float32)
    if not (array.flags.owndata and array.flags.writeable):
        # a view of the read-only mapped file (a float32 tensor): copied; a decoded array is
        # already the process's own (a second copy was 400 MB more for a 1B model's embedding)
        array = array.copy()
    return torch.from_numpy(array.reshape(shape))


def _unpermute_tensor(tensor: GGUFTensor, n_head: int) -> GGUFTensor:
    """`_unpermute` on the file's rows, before they are decoded: every format here decodes a
    row from that row's bytes alone, so the result is the same, without a copy of the
    decoded weight."""
    rows = tensor.data.shape[0]
    order = _unpermute(torch.arange(rows)[:, None], n_head)[:, 0].numpy()
    return replace(tensor, data=np.take(tensor.data, order, axis=0))


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order.

    Hugging Face rotates the two halves of each head (`rotate_half`); llama.cpp rotates adjacent
    pairs, so its converter moves row `h*d + i` (first half) to `h*d + 2i` and row
    `h*d + d/2 + i` to `h*d + 2i + 1`. Read back: rows of a head as [d/2, 2] -> [2, d/2].
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    return (
        weight.reshape(n_head, half, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


# ---------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str | Path, eos_token_ids: list[int] | None = None) -> HFTokenizer:
    """The GGUF's tokenizer as an `HFTokenizer`, tokenising as transformers does from the file."""
    from tokenizers import Tokenizer

    from stallfree.runtime.text.tokenizer import HFTokenizer, TokenizerLoadError

    path = Path(path)
    index, _ = _open(path, TokenizerLoadError)
    entry = index.tokenizer
    if entry is None:  # the index has none: building it again raises why
        entry = _tokenizer_entry(_parsed_metadata(path, TokenizerLoadError), path)
    return HFTokenizer.from_raw(
        Tokenizer.from_str(entry.json),
        bos_token=entry.bos_token,
        eos_token=entry.eos_token,
        chat_template=entry.chat_template,
        eos_token_ids=eos_token_ids,
    )


def _tokenizer_entry(meta: _Metadata, path: Path) -> TokenizerEntry:
    """The tokenizer the `tokenizer.ggml.*` fields describe, as the index keeps it."""
    from stallfree.runtime.text.tokenizer import TokenizerLoadError

    kind = meta.require("tokenizer.ggml.model")
    tokens = [str(t) for t in meta.require("tokenizer.ggml.tokens")]
    if kind == "gpt2":
        raw = _byte_level_bpe(meta, tokens)
        add_bos_default = False
    elif kind == "llama":
        raw = _sentencepiece_bpe(meta, tokens)
        add_bos_default = True  # llama.cpp adds BOS to a sentencepiece vocabulary by default
    else:
        raise TokenizerLoadError(
            f"{path}: unsupported GGUF tokenizer {kind!r}; supported: gpt2 (byte-level BPE), "
            "llama (sentencepiece BPE)"
        )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    bos = tokens[int(bos_id)] if bos_id is not None else ""
    eos = tokens[int(eos_id)] if eos_id is not None else ""
    add_bos = bool(bos) and bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(eos) and bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        from tokenizers import processors

        pre = f"{bos} " if add_bos else ""
        post = f" {eos}" if add_eos else ""
        specials = [(bos, int(bos_id))] if add_bos else []
        if add_eos and eos != bos:
            specials.append((eos, int(eos_id)))
        raw.post_processor = processors.TemplateProcessing(
            single=f"{pre}$A{post}", pair=f"{pre}$A{post} {pre}$B{post}", special_tokens=specials
        )
    template = meta.get("tokenizer.chat_template")
    return TokenizerEntry(
        json=raw.to_str(),
        bos_token=bos,
        eos_token=eos,
        chat_template=str(template) if template else None,
    )


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str]) -> Any:
    """Llama/Mistral-style sentencepiece BPE: `▁` for spaces, byte fallback, merges from the
    file or, when it has none, rebuilt from the token scores (best merge first)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    stored = meta.get("tokenizer.ggml.merges")
    if stored:
        merges = [tuple(m.split(" ", 1)) for m in stored]
    else:
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        merges = _merges_from_scores(tokens, scores, vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    raw = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[int(unk_id)] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    raw.decoder = decoders.Sequence(steps)
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED
    ]
    if control:
        raw.add_special_tokens(control)
    if user:
        raw.add_tokens(user)
    return raw


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the merged token's score
    (then the longer left and right parts first; ties keep vocabulary order)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=False):
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((float(score), len(left), len(right), left, right) for left, right in splits)
    ranked.sort(key=lambda m: (-m[0], -m[1], -m[2]))  # stable: equal keys keep their order
    return [(left, right) for _, _, _, left, right in ranked]


def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, which byte-level vocabularies are written in."""
    direct = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in direct}
    shifted = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(0x100 + shifted)
            shifted += 1
    return spelling


def _byte_level_bpe(meta: _Metadata, tokens: list[str]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_spelling()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        # added tokens may be stored as plain text; the BPE vocabulary holds byte spellings
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in (meta.get("tokenizer.ggml.merges") or [])]
    raw = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_SPLITS.get(str(meta.get("tokenizer.ggml.pre") or ""))
    if split is None:
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raw.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    # control tokens whole and special; one spelled outside the byte alphabet is a mislabel
    # that would grow the vocabulary, so it stays a plain vocabulary entry
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and t in vocab
    ]
    if control:
        raw.add_special_tokens(control)
    if user:
        raw.add_tokens(user)
    return raw
