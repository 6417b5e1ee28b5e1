"""Hugging Face directory and GGUF file loading, and seeded random presets."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from stallfree.runtime.memory.heap import release_free_heap
from stallfree.runtime.memory.huge_pages import move_to_huge_pages
from stallfree.runtime.memory.pool import KVCacheShape
from stallfree.runtime.model import cpu_kernels, native_layers
from stallfree.runtime.model.arch import ModelArchConfig, ModelLoadError
from stallfree.runtime.model.bert import ENCODER_ARCHITECTURES
from stallfree.runtime.model.compact_only import keep_compact_only
from stallfree.runtime.model.cross_encoder import CROSS_ENCODER_ARCHITECTURES
from stallfree.runtime.model.fused_weights import is_fused, split_fused
from stallfree.runtime.model.gemma import GEMMA_MODELS
from stallfree.runtime.model.hf_fallback import TransformersForCausalLM, hidden_size, resolve_impl
from stallfree.runtime.model.llama import LlamaForCausalLM
from stallfree.runtime.model.native_layers import use_native_linears
from stallfree.runtime.model.padded_rows import pad_rows
from stallfree.runtime.model.parallel import (
    TPGroup,
    apply_shard,
    local_heads,
    local_kv_heads,
    pad_shard,
    shard_spec,
    validate_tp,
)
from stallfree.runtime.model.quant import (
    check_method,
    cpu_has_bf16,
    describe,
    weight_bytes,
)
from stallfree.runtime.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def is_gguf_path(path: str | Path) -> bool:
    """A single-file GGUF checkpoint, by its suffix (any case)."""
    return str(path).lower().endswith(".gguf")


class _MetaInitSkipped(TorchFunctionMode):
    """Builds a model on the meta device without running its init functions.

    NOTE: meta tensors hold no values, yet `normal_` on one (nn.Embedding's init) runs torch's
    Python reference, whose first call imports torch._dynamo: about a second of start-up that
    serving never needs otherwise."""

    _SKIPPED = frozenset({torch.nn.init.normal_, torch.Tensor.normal_})

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
        if func in self._SKIPPED and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------- presets

_BYTE_TOKENIZER: dict[str, Any] = {"vocab_size": 260, "bos_token_id": 256, "eos_token_ids": [257]}

PRESETS: dict[str, ModelArchConfig] = {
    "tiny": ModelArchConfig(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        architecture="preset:tiny",
        **_BYTE_TOKENIZER,
    ),
    "bench-cpu": ModelArchConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_layers=4,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        architecture="preset:bench-cpu",
        **_BYTE_TOKENIZER,
    ),
}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM | TransformersForCausalLM
    arch: ModelArchConfig  # the full model's shape (every rank sees the same)
    dtype: torch.dtype
    path: str | None
    name: str
    tp: TPGroup = field(default_factory=TPGroup)
    quantization: str = "none"  # the method applied (quant.py)

    @property
    def local_num_heads(self) -> int:
        """Query heads on this rank."""
        return local_heads(self.arch, self.tp)

    @property
    def local_num_kv_heads(self) -> int:
        """KV heads on this rank: the head count of this rank's KV cache."""
        return local_kv_heads(self.arch, self.tp)

    def kv_cache_shape(self) -> KVCacheShape:
        """This rank's KV cache shape (its local KV heads)."""
        return KVCacheShape(self.arch.num_layers, self.local_num_kv_heads, self.arch.head_dim)


def load_model(
    path_or_preset: str,
    dtype: str,
    device: torch.device,
    seed: int,
    tp: TPGroup | None = None,
    quantization: str = "none",
    model_impl: str = "auto",
    trust_remote_code: bool = False,
    prepack_prompt_weights: bool = False,
    compact_decode_weights: str | bool = "off",
) -> LoadedModel:
    """The model through transformers' modelling code when `model_impl` says so (hf_fallback.py:
    `transformers`, or `auto` for an architecture with no native family; a checkpoint's own
    code only with `trust_remote_code`), else `_load`; then a native family's dense bfloat16
    linears switched to the native kernels (native_layers.py) where the CPU has them (with
    `prepack_prompt_weights`, each beside a oneDNN copy for prompts; with
    `compact_decode_weights` "beside" (or True), beside a compact copy for decode rows, with
    "only", in that form alone: compact_only.py) and, on the CPU, their rows padded by a cache
    line (padded_rows.py), a CPU model's weights moved to huge pages (memory/huge_pages.py),
    and the load's freed memory handed back."""
    compact_mode(compact_decode_weights, "meta", tp)  # the setting checked before the load
    if model_impl_for(path_or_preset, model_impl) == "transformers":
        path, device = Path(path_or_preset), torch.device(device)
        loaded = _load_fallback(path, dtype, device, tp, quantization, trust_remote_code)
    else:
        loaded = _load(path_or_preset, dtype, device, seed, tp, quantization)
    if isinstance(loaded.model, LlamaForCausalLM):
        compact = compact_mode(compact_decode_weights, device, tp)
        use_native_linears(
            loaded.model, prepack=prepack_prompt_weights, compact=compact == "beside"
        )
        if compact == "only":
            keep_compact_only(loaded.model)
        if compact != "off":
            loaded.model.compact_tied_head()
        if torch.device(device).type == "cpu":
            pad_rows(loaded.model)
    release_free_heap()  # the load's temporaries (memory/heap.py)
    if torch.device(device).type == "cpu" and move_to_huge_pages(loaded.model):
        release_free_heap()  # the storages the weights were moved from
    return loaded


def compact_mode(setting: str | bool, device: torch.device | str, tp: TPGroup | None) -> str:
    """`compact_decode_weights` as `load_model` applies it: True / False are beside / off, only
    is refused past one rank, and auto is only on a CPU whose native kernels are the AVX2
    variant, on one rank, else off.
    (On that variant the compact form's product takes every decode row count the dense kernel
    takes, at its bits, and a prompt's widened product decodes it about as fast as it widens
    the dense weight; on the AVX-512 variant, and with the AMX tiles, decode steps of more
    rows read the dense weight faster.)"""
    mode = setting
    if isinstance(mode, bool):
        mode = "beside" if mode else "off"
    if mode not in ("auto", "off", "beside", "only"):
        raise ValueError(f"compact_decode_weights must be auto, off, beside or only, not {mode!r}")
    one_rank = tp is None or tp.size == 1
    if mode == "only" and not one_rank:
        raise ValueError(
            "compact_decode_weights=only runs on one rank (tensor parallelism's "
            "partial products read the dense weights)"
        )
    if mode == "auto":
        cpu = torch.device(device).type == "cpu"
        mode = "only" if cpu and one_rank and cpu_kernels.isa() == "avx2" else "off"
    return mode


def _load(
    path_or_preset: str,
    dtype: str,
    device: torch.device,
    seed: int,
    tp: TPGroup | None,
    quantization: str,
) -> LoadedModel:
    """Load a Hugging Face model directory or a .gguf file natively, or build a preset with
    seeded random weights.

    With `tp` of size > 1 the model is this rank's shard: a directory's safetensors are read
    slice by slice (only this rank's part), and a preset's full seeded weights are built and
    sliced, so every tp size runs the same model. `quantization` (quant.py) keeps the linear
    weights packed: `int8` / `int4` quantize any checkpoint's, `gguf` keeps a GGUF file's
    blocks, `auto` is `gguf` for a GGUF file on a CPU and `none` otherwise.
    """
    device = torch.device(device)
    tp = tp if tp is not None else TPGroup()
    method = resolve_quantization(quantization, path_or_preset, device)
    if path_or_preset in PRESETS:
        loaded = _load_preset(path_or_preset, dtype, device, seed, tp)
    else:
        path = Path(path_or_preset)
        if is_gguf_path(path) and path.is_file():
            if tp.size > 1:
                raise _gguf_tp_error(tp.size)
            return _load_gguf(path, dtype, device, method)
        if not path.is_dir():
            raise ModelLoadError(
                f"model path {path_or_preset!r} does not exist; expected a Hugging Face "
                f"directory, a .gguf file or a preset: {', '.join(PRESETS)}"
            )
        loaded = _load_directory(path, dtype, device, tp)
    if fuses(loaded.model, loaded.dtype, method, device):
        loaded.model.fuse_projections()
    if method in ("int8", "int4"):
        _quantize(loaded, method)
    return loaded


def model_impl_for(path_or_preset: str, model_impl: str = "auto") -> str:
    """`native` or `transformers`: what `load_model` builds (presets and GGUF: native only)."""
    path = Path(path_or_preset)
    is_dir = path_or_preset not in PRESETS and not is_gguf_path(path) and path.is_dir()
    cfg = _read_config(path) if is_dir else None
    _refuse_encoder(cfg)
    return resolve_impl(cfg, model_impl, path_or_preset)


def _refuse_encoder(cfg: dict[str, Any] | None) -> None:
    """An encoder (an embedder or a cross-encoder) is no causal LM: transformers' fallback
    would otherwise build it one with an untrained head and generate noise."""
    archs = (cfg or {}).get("architectures") or []
    encoders = [a for a in archs if a in ENCODER_ARCHITECTURES | CROSS_ENCODER_ARCHITECTURES]
    if encoders:
        raise ModelLoadError(
            f"{encoders[0]} is an encoder: it cannot generate; it runs on the pooling runner "
            "(`stallfree serve` picks it; --runner pooling)"
        )


def _load_fallback(
    path: Path,
    dtype: str,
    device: torch.device,
    tp: TPGroup | None,
    quantization: str,
    trust_remote_code: bool = False,
) -> LoadedModel:
    method = resolve_quantization(quantization, str(path), device)
    size = tp.size if tp is not None else 1
    cfg = _read_config(path)
    torch_dtype = _resolve_dtype(dtype, _config_dtype(cfg), device, hidden_size(cfg))
    model = TransformersForCausalLM.load(path, torch_dtype, device, size, method, trust_remote_code)
    return LoadedModel(model, model.arch, torch_dtype, str(path), path.name)


def fuses(model: torch.nn.Module, dtype: torch.dtype, method: str, device: torch.device) -> bool:
    """Whether q/k/v and gate/up run as one matmul each (`fuse_projections`): everywhere but
    a dense float32 model, whose output equals transformers' bit for bit only unfused, unless
    its products leave torch's sums anyway (a native model where
    `native_layers.stacks_float32`: a CPU not Intel's, the kernels built)."""
    if dtype not in (torch.float32, torch.float64) or method != "none":
        return True
    return (
        dtype == torch.float32
        and isinstance(model, LlamaForCausalLM)
        and native_layers.stacks_float32(device)
    )


def resolve_quantization(quantization: str, path_or_preset: str, device: torch.device) -> str:
    """The method `load_model` applies; `gguf` on anything but a GGUF file is an error."""
    gguf_file = path_or_preset not in PRESETS and is_gguf_path(path_or_preset)
    if quantization == "auto":
        return "gguf" if gguf_file and device.type == "cpu" else "none"
    try:
        check_method(quantization, device)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    if quantization == "gguf" and not gguf_file:
        raise ModelLoadError(
            "quantization=gguf keeps a GGUF file's blocks; for other checkpoints use int8 or int4"
        )
    return quantization


def _quantize(loaded: LoadedModel, method: str, packed: dict[str, Any] | None = None) -> None:
    start = time.perf_counter()
    before = weight_bytes(loaded.model)
    layers = loaded.model.quantize(method, loaded.dtype, packed)
    loaded.quantization = method
    logger.info(
        "quantization %s: %s; weights %.1f MB (%.1f MB dense) in %.2f s",
        method,
        describe(layers),
        weight_bytes(loaded.model) / 1e6,
        before / 1e6,
        time.perf_counter() - start,
    )


# "auto" takes bfloat16 on a CPU only for models at least this wide: on narrower ones the
# matrix work is too small a share of a step to gain (tiny, hidden 64: 0.93x the float32
# output tok/s; SmolLM2-135M, hidden 576: 1.44x at 16 concurrent requests)
BF16_MIN_HIDDEN = 512


def _resolve_dtype(
    dtype: str, config_dtype: str | None, device: torch.device, hidden_size: int
) -> torch.dtype:
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ModelLoadError(f"unsupported dtype {dtype!r}; expected auto or {list(_DTYPES)}")
        return _DTYPES[dtype]
    resolved = _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.float32)
    if device.type != "cpu":
        return resolved
    # on a CPU, "auto" means what its matrix units take: bfloat16 where it has AVX512-BF16 or
    # AMX (as vLLM's CPU backend picks) and the model is wide enough, else float32; float16
    # matmuls are slow on CPUs
    wide = hidden_size >= BF16_MIN_HIDDEN
    return torch.bfloat16 if wide and cpu_has_bf16() else torch.float32


def _load_preset(
    name: str, dtype: str, device: torch.device, seed: int, tp: TPGroup
) -> LoadedModel:
    arch = replace(PRESETS[name], eos_token_ids=list(PRESETS[name].eos_token_ids))
    validate_tp(arch, tp.size)
    torch_dtype = _resolve_dtype(dtype, "float32", device, arch.hidden_size)
    model = LlamaForCausalLM(arch, device=torch.device("cpu"), dtype=torch.float32)
    _init_random(model, torch.Generator().manual_seed(seed))
    _mute_unprintable(model)
    if tp.size > 1:
        # the same full model at every tp size, then this rank's slices of it
        full = model.state_dict()
        model = LlamaForCausalLM(arch, device=torch.device("meta"), dtype=torch.float32, tp=tp)
        state = {
            key: apply_shard(full[key], shard_spec(key, arch, tp.rank, tp.size))
            for key, _ in model.named_parameters()
        }
        model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device=device, dtype=torch_dtype).eval()
    return LoadedModel(model=model, arch=arch, dtype=torch_dtype, path=None, name=name, tp=tp)


def _init_random(model: LlamaForCausalLM, gen: torch.Generator) -> None:
    """std 0.1 at width 64, shrinking as 1/sqrt(fan_in) so wider presets keep unit-scale
    activations while the tiny preset's logits stay peaky."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                fan_in = param.shape[1] if not name.endswith("embed_tokens.weight") else 64
                std = 0.1 * math.sqrt(64 / fan_in)
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def _mute_unprintable(model: LlamaForCausalLM) -> None:
    """Zero the output rows of bytes outside printable ASCII and of the specials.

    A random byte-level model otherwise streams invalid UTF-8; with these rows at logit 0 the
    argmax is almost always a printable byte, so demos print text.
    """
    keep = torch.zeros(model.arch.vocab_size, dtype=torch.bool)
    keep[32:127] = True
    keep[10] = True
    with torch.no_grad():
        model.lm_head_weight()[~keep] = 0.0


# ---------------------------------------------------------------------------- directories


def read_arch(path_or_preset: str) -> ModelArchConfig:
    """The model's full shape without loading its weights (a preset, a directory's
    config.json, or a GGUF file's metadata)."""
    if path_or_preset in PRESETS:
        preset = PRESETS[path_or_preset]
        return replace(preset, eos_token_ids=list(preset.eos_token_ids))
    path = Path(path_or_preset)
    if is_gguf_path(path) and path.is_file():
        from stallfree.runtime.model.gguf import read_gguf_arch

        return read_gguf_arch(path)
    if not path.is_dir():
        raise ModelLoadError(
            f"model path {path_or_preset!r} does not exist; expected a Hugging Face directory, "
            f"a .gguf file or a preset: {', '.join(PRESETS)}"
        )
    return ModelArchConfig.from_hf(_read_config(path))


def weights_dtype(path_or_preset: str, dtype: str, device: torch.device) -> torch.dtype:
    """The dtype `load_model` loads the weights in, without loading them (the scheduler's
    process sizes its pools with it when the model lives in worker processes)."""
    path = Path(path_or_preset)
    hidden = read_arch(path_or_preset).hidden_size if dtype == "auto" else 0
    if path_or_preset in PRESETS or is_gguf_path(path):
        # seeded float32; dequantised float32
        return _resolve_dtype(dtype, "float32", device, hidden)
    return _resolve_dtype(dtype, _config_dtype(_read_config(path)), device, hidden)


def _config_dtype(cfg: dict[str, Any]) -> str | None:
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return None if dtype is None else str(dtype)


def check_tensor_parallel(path_or_preset: str, tp_size: int) -> None:
    """Raise `ModelLoadError` (a ValueError) when the model cannot run split over `tp_size`
    ranks: a head count that does not divide, or a GGUF file. Reads no weights."""
    if tp_size == 1:
        return
    path = Path(path_or_preset)
    if path_or_preset not in PRESETS and is_gguf_path(path):
        raise _gguf_tp_error(tp_size)
    validate_tp(read_arch(path_or_preset), tp_size)


def _gguf_tp_error(tp_size: int) -> ModelLoadError:
    return ModelLoadError(
        f"GGUF models are not supported with tensor parallelism yet (tp_size={tp_size}); "
        "use a Hugging Face safetensors directory or tp_size=1"
    )


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    cfg: dict[str, Any] = json.loads(config_file.read_text())
    return cfg


def causal_lm(arch: ModelArchConfig) -> type[LlamaForCausalLM]:
    """The native model class of `arch`'s architecture (Gemma's, else the Llama family's)."""
    return GEMMA_MODELS.get(arch.architecture, LlamaForCausalLM)


def _load_directory(path: Path, dtype: str, device: torch.device, tp: TPGroup) -> LoadedModel:
    cfg = _read_config(path)
    arch = ModelArchConfig.from_hf(cfg)
    validate_tp(arch, tp.size)
    torch_dtype = _resolve_dtype(dtype, _config_dtype(cfg), device, arch.hidden_size)
    # Meta construction skips a throwaway random init of every weight.
    with _MetaInitSkipped():
        model = causal_lm(arch)(arch, device=torch.device("meta"), dtype=torch_dtype, tp=tp)
    if tp.size == 1:
        state = _read_safetensors(path, model, device, torch_dtype)
    else:
        state = _read_safetensors_shards(path, model, device, torch_dtype, tp)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device).eval()
    return LoadedModel(
        model=model, arch=arch, dtype=torch_dtype, path=str(path), name=path.name, tp=tp
    )


def _load_gguf(path: Path, dtype: str, device: torch.device, method: str) -> LoadedModel:
    with _one_torch_thread():
        return _load_gguf_file(path, dtype, device, method)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """NOTE: a GGUF load is hundreds of small repacking ops, and a parallel region waits for
    all its threads: on a busy machine one descheduled thread stalls each op, so two threads
    loaded SmolLM2's Q4_1 in 2.6-5.1 s where one took 1.0-1.6 s (load average 4, 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _load_gguf_file(path: Path, dtype: str, device: torch.device, method: str) -> LoadedModel:
    from stallfree.runtime.model.gguf import read_gguf_arch, read_gguf_checkpoint

    # dequantised weights are float32; each is converted to the model's dtype as it is read
    torch_dtype = _resolve_dtype(dtype, "float32", device, read_gguf_arch(path).hidden_size)
    ckpt = read_gguf_checkpoint(path, keep_quantized=method == "gguf", dtype=torch_dtype)
    with _MetaInitSkipped():
        model = causal_lm(ckpt.arch)(ckpt.arch, device=torch.device("meta"), dtype=torch_dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for key, tensor in ckpt.tensors.items():
        _check_shape(key, tuple(tensor.shape), expected)
    _check_complete(set(ckpt.tensors), set(expected))
    dense = {k: t for k, t in ckpt.tensors.items() if isinstance(t, torch.Tensor)}
    packed = {k: t for k, t in ckpt.tensors.items() if not isinstance(t, torch.Tensor)}
    state = {k: t.to(device=device, dtype=torch_dtype) for k, t in dense.items()}
    # the packed weights' parameters stay on the meta device until their layers are swapped
    model.load_state_dict(state, strict=False, assign=True)
    # the model holds the weights now: without these references fusing q/k/v and gate/up
    # below frees each part as its stack is made (a 1B model's peak was 1.2 GB higher)
    del state, dense
    ckpt.tensors.clear()
    loaded = LoadedModel(
        model=model, arch=ckpt.arch, dtype=torch_dtype, path=str(path), name=path.stem
    )
    if fuses(model, torch_dtype, method, device):
        model.fuse_projections(packed)
    if packed:
        _quantize(loaded, method, packed)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ModelLoadError(f"{path}: no weights for {', '.join(left[:8])}")
    loaded.model = model.to(device).eval()
    if method in ("int8", "int4"):
        _quantize(loaded, method)
    return loaded


def _read_safetensors(
    path: Path, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {str(path)!r} has no *.safetensors files")
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key == "lm_head.weight" and model.arch.tie_word_embeddings:
                    continue  # some tied checkpoints still store the duplicate
                if is_fused(key, model.arch):  # Phi-3's qkv_proj / gate_up_proj
                    for name, part in split_fused(key, f.get_tensor(key), model.arch):
                        _check_shape(name, tuple(part.shape), expected)
                        state[name] = part.to(dtype)
                    continue
                _check_shape(key, tuple(f.get_slice(key).get_shape()), expected)
                state[key] = f.get_tensor(key).to(dtype)
    _check_complete(set(state), set(expected))
    return state


def _read_safetensors_shards(
    path: Path, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype, tp: TPGroup
) -> dict[str, torch.Tensor]:
    """This rank's slice of each tensor, read with `get_slice` (the rest is never read)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {str(path)!r} has no *.safetensors files")
    arch = model.arch
    # checkpoint shapes are the full model's (a meta model costs no memory)
    with _MetaInitSkipped():
        full = causal_lm(arch)(arch, device=torch.device("meta"), dtype=dtype)
    expected = {name: tuple(p.shape) for name, p in full.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key == "lm_head.weight" and arch.tie_word_embeddings:
                    continue
                view = f.get_slice(key)
                if is_fused(key, arch):  # read whole, then each part's slice
                    for name, part in split_fused(key, view[:], arch):
                        _check_shape(name, tuple(part.shape), expected)
                        part = apply_shard(part, shard_spec(name, arch, tp.rank, tp.size))
                        state[name] = part.to(device=device, dtype=dtype)
                    continue
                _check_shape(key, tuple(view.get_shape()), expected)
                spec = shard_spec(key, arch, tp.rank, tp.size)
                if spec is None:
                    part = view[:]
                elif spec.dim == 0:
                    part = pad_shard(view[spec.start : spec.end], spec)
                else:
                    part = pad_shard(view[:, spec.start : spec.end], spec)
                state[key] = part.to(device=device, dtype=dtype)
    _check_complete(set(state), set(expected))
    return state


def _check_shape(key: str, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]]) -> None:
    if key not in expected:
        raise ModelLoadError(f"unexpected tensor in checkpoint: {key}")
    if shape != expected[key]:
        raise ModelLoadError(
            f"shape mismatch for {key}: checkpoint has {list(shape)}, "
            f"config expects {list(expected[key])}"
        )


def _check_complete(found: set[str], expected: set[str]) -> None:
    missing = sorted(expected - found)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        )
        raise ModelLoadError(f"missing tensors in checkpoint: {shown}")


def load_tokenizer(path_or_preset: str, eos_token_ids: list[int] | None = None) -> Tokenizer:
    if path_or_preset in PRESETS:
        return ByteTokenizer()
    if is_gguf_path(path_or_preset):
        from stallfree.runtime.model.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path_or_preset, eos_token_ids)
    return HFTokenizer(path_or_preset, eos_token_ids)
