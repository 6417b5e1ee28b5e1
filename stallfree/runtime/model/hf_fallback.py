"""The transformers fallback (`model.model_impl` / `--model-impl transformers`).

Any causal LM that transformers can build from a checkpoint's config.json runs through
transformers' own modelling code, with stallfree's paged KV cache and attention in place of
its attention: the function registered as the `stallfree` attention implementation
(`transformers.AttentionInterface`) receives each layer's query, key and value (positions
already applied by the model), writes the new K/V into the KV cache and attends through the
engine's `PagedAttention`, for the step's `ForwardBatch`, which a context variable carries
from `TransformersForCausalLM.forward` down to it.

The whole batch runs as one flattened sequence [1, T] with each token's own position and no
transformers cache; attention, not a mask, keeps the requests apart. Slower than a native
family, with the same interface, so scheduling, mirrors, overlap and the prefix cache are
unchanged. transformers is imported only here, and only when a model needs it.
"""

from __future__ import annotations

import contextvars
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stallfree.runtime.model.arch import FAMILIES, ModelArchConfig, ModelLoadError
from stallfree.runtime.model.attention import PagedAttention
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode

IMPL_NAME = "stallfree"
MODEL_IMPLS = ("auto", "native", "transformers")
INSTALL_HINT = "pip install transformers (or stallfree[transformers])"
# the auto_map entry of a checkpoint that brings its own causal LM code
_REMOTE_CLASS = "AutoModelForCausalLM"


@dataclass(slots=True)
class _Probe:
    """What the load-time probe forward saw of each attention call."""

    layers: list[int | None] = field(default_factory=list)
    shapes: set[tuple[int, int, int]] = field(default_factory=set)  # (kv heads, k dim, v dim)
    refusals: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Step:
    model: TransformersForCausalLM | None  # None: the probe
    fb: ForwardBatch | None
    probe: _Probe | None = None


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar(
    "stallfree_hf_step", default=None
)


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelLoadError(f"model_impl=transformers needs transformers: {INSTALL_HINT}") from exc
    return transformers


def transformers_builds(cfg: dict[str, Any]) -> bool:
    """Whether the installed transformers (if any) has a causal LM for this config.json, or
    the checkpoint brings its own (`auto_map`; it runs only with trust_remote_code)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    if cfg.get("is_encoder_decoder"):
        return False
    if _REMOTE_CLASS in (cfg.get("auto_map") or {}):
        return True
    return cfg.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def resolve_impl(cfg: dict[str, Any] | None, model_impl: str, model: str = "") -> str:
    """`native` or `transformers` for a checkpoint's config.json (None: a preset, a GGUF file
    or no directory, native only). `auto`: native when the architecture is one of FAMILIES,
    else transformers when it can build it, else native (whose error names the architecture
    and the supported ones)."""
    if model_impl not in MODEL_IMPLS:
        raise ModelLoadError(
            f"unknown model_impl {model_impl!r}; expected {', '.join(MODEL_IMPLS)}"
        )
    if cfg is None:
        if model_impl == "transformers":
            raise refuse(f"runs Hugging Face directories; {model!r} runs natively only")
        return "native"
    if model_impl != "auto":
        return model_impl
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if (archs and archs[0] in FAMILIES) or any(
        model_type in f.model_types for f in FAMILIES.values()
    ):
        return "native"
    return "transformers" if transformers_builds(cfg) else "native"


def _remote_hint(exc: Exception) -> str:
    """transformers' error, or what to do when it is the checkpoint's code it would not run."""
    if "trust_remote_code" in str(exc):
        return (
            "it needs its own modelling code; --trust-remote-code (model.trust_remote_code) runs it"
        )
    return str(exc)


def hidden_size(cfg: dict[str, Any]) -> int:
    """The model's width from a config.json, by any of its usual names (0 if none)."""
    text = cfg.get("text_config") or cfg
    return int(text.get("hidden_size") or text.get("n_embd") or text.get("d_model") or 0)


def refuse(what: str) -> ModelLoadError:
    """The fallback's error; one that cannot run the model at all also lists the native ones."""
    native = f"; native architectures: {', '.join(FAMILIES)}" if what.startswith("cannot") else ""
    return ModelLoadError(f"the transformers fallback (model_impl=transformers) {what}{native}")


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The `stallfree` attention implementation: query [1, H, T, D], key/value [1, KVH, T, D]
    -> ([1, T, H, D], no weights)."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError(
            "the stallfree attention implementation runs only inside TransformersForCausalLM"
        )
    layer = getattr(module, "layer_idx", None)
    if step.probe is not None:
        probe = step.probe
        probe.layers.append(layer)
        probe.shapes.add((int(key.shape[1]), int(key.shape[-1]), int(value.shape[-1])))
        if attention_mask is not None:
            probe.refusals.append("passes its own attention mask or bias (ALiBi?)")
        if softcap is not None:
            probe.refusals.append(f"soft-caps attention scores (softcap={softcap})")
        if kwargs.get("is_causal") is False:
            probe.refusals.append("has non-causal attention")
        return query.new_zeros(query.transpose(1, 2).shape), None
    assert step.model is not None and step.fb is not None and layer is not None
    return step.model.attend(query, key, value, int(layer), step.fb, scaling, sliding_window), None


def _register(transformers: Any) -> None:
    transformers.AttentionInterface.register(IMPL_NAME, _attention)


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM behind the native models' interface: `forward(fb)` returns
    float32 logits [rows, vocab] (each request's last token, or `fb.logit_rows`, then
    `fb.logit_positions`), `arch`, `attn_backend`. torch.compile, fused projections and
    quantization are native-only (refused, or a no-op for fusion)."""

    def __init__(self, hf: nn.Module, arch: ModelArchConfig) -> None:
        super().__init__()
        self.hf = hf
        self.arch = arch
        self.attn_backend = PagedAttention(None)
        self._windowed: dict[int, PagedAttention] = {}
        self._keeps_rows = "logits_to_keep" in inspect.signature(hf.forward).parameters
        self._device = next(hf.parameters()).device

    @classmethod
    def load(
        cls,
        path: Path,
        dtype: torch.dtype,
        device: torch.device,
        tp_size: int,
        method: str,
        trust_remote_code: bool = False,
    ) -> TransformersForCausalLM:
        """Build the model from a local directory (no network), on `device` in `dtype`; the
        checkpoint's own modelling code (`auto_map`) runs only with `trust_remote_code`."""
        if tp_size > 1:
            raise refuse(f"runs one rank; tensor parallelism (tp_size={tp_size}) is native-only")
        if method != "none":
            raise refuse(f"runs dense weights only; quantization={method} is native-only")
        transformers = _import_transformers()
        _register(transformers)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        remote = {"trust_remote_code": trust_remote_code, "local_files_only": True}
        try:
            config = transformers.AutoConfig.from_pretrained(str(path), **remote)
        except (ValueError, KeyError, OSError) as exc:
            raise refuse(f"cannot read {path.name!r}'s config: {_remote_hint(exc)}") from exc
        name = (getattr(config, "architectures", None) or [config.model_type])[0]
        if getattr(config, "is_encoder_decoder", False):
            raise refuse(f"cannot run {name}, an encoder-decoder model: decoder-only LMs only")
        model_cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
        code = (getattr(config, "auto_map", None) or {}).get(_REMOTE_CLASS)
        if model_cls is None and code is not None and trust_remote_code:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            model_cls = get_class_from_dynamic_module(code, str(path), local_files_only=True)
        if model_cls is None:
            hint = " (the checkpoint brings its own: --trust-remote-code runs it)" if code else ""
            raise refuse(
                f"cannot build {name}: transformers {transformers.__version__} has no causal "
                f"LM for model_type {config.model_type!r}{hint}"
            )
        if not getattr(model_cls, "_supports_attention_backend", False):
            raise refuse(
                f"cannot run {model_cls.__name__}: its attention does not go through "
                "transformers' attention interface (_supports_attention_backend is not set)"
            )
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(path),
                config=config,
                dtype=dtype,
                attn_implementation=IMPL_NAME,
                **remote,
            )
        except (ValueError, OSError) as exc:
            raise refuse(f"cannot build {model_cls.__name__}: {exc}") from exc
        hf = hf.to(device).eval()
        return cls(hf, _probe_arch(hf, config))

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: int,
        fb: ForwardBatch,
        scaling: float | None,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """One layer through the paged cache: [1, H, T, D] in, [1, T, H, D] out."""
        q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        head_dim = q.shape[-1]
        if scaling is not None and not math.isclose(scaling * math.sqrt(head_dim), 1.0):
            q = q * (scaling * math.sqrt(head_dim))  # SDPA's own scale is head_dim ** -0.5
        backend = self.attn_backend
        if sliding_window is not None:
            backend = self._windowed.setdefault(sliding_window, PagedAttention(sliding_window))
        return backend.forward(q, k, v, layer, fb)[None]

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.mode is ForwardMode.IDLE or fb.batch_size == 0:
            return torch.empty((0, self.arch.vocab_size), dtype=torch.float32, device=self._device)
        rows = _logit_rows(fb)
        kwargs: dict[str, Any] = {}
        if self._keeps_rows:
            kwargs["logits_to_keep"] = rows if rows is not None else 0
        token = _STEP.set(_Step(self, fb))
        try:
            out = self.hf(
                input_ids=fb.input_ids[None],
                position_ids=fb.positions[None],
                use_cache=False,
                return_dict=True,
                **kwargs,
            )
        finally:
            _STEP.reset(token)
        logits: torch.Tensor = out.logits[0]
        if rows is not None and not self._keeps_rows:
            logits = logits.index_select(0, rows)
        return logits[:, : self.arch.vocab_size].float()

    def compile_layers(self) -> None:
        raise ValueError(
            "runtime.torch_compile compiles native models only; the transformers fallback "
            "(model_impl=transformers) runs eager"
        )

    def fuse_projections(self, packed: dict[str, Any] | None = None) -> int:
        """A no-op: transformers' modules keep their own projections."""
        return 0

    def quantize(
        self, method: str, dtype: torch.dtype, packed: dict[str, Any] | None = None
    ) -> dict[str, nn.Module]:
        if method == "none":
            return {}
        raise refuse(f"runs dense weights only; quantization={method} is for native models")


def _logit_rows(fb: ForwardBatch) -> torch.Tensor | None:
    """The flat token rows whose logits the step returns (device), or None for all of them."""
    if fb.logit_rows is not None:
        rows: torch.Tensor | None = fb.logit_rows
    elif fb.mode in (ForwardMode.DECODE, ForwardMode.VERIFY) or all(
        n == 1 for n in fb.extend_lens_cpu
    ):
        rows = None
    else:
        ends, total = [], 0
        for n in fb.extend_lens_cpu:
            total += n
            ends.append(total - 1)
        rows = _upload(ends, fb.input_ids.device)
    if fb.logit_positions is None:
        return rows
    if rows is None:
        rows = torch.arange(fb.num_tokens, device=fb.input_ids.device)
    return torch.cat([rows, fb.logit_positions])


def _upload(host: list[int], device: torch.device) -> torch.Tensor:
    cpu = torch.tensor(host, dtype=torch.int64)
    if device.type == "cuda":
        # NOTE: pinned + non_blocking: queued on the current stream, not waited on
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


def _probe_arch(hf: nn.Module, config: Any) -> ModelArchConfig:
    """Run three tokens through the model with a recording attention: every layer must go
    through the interface with a layer index, one KV shape, no mask of its own, no soft-cap.
    The KV cache's shape (layers, KV heads, head dim) comes from what the layers passed."""
    probe = _Probe()
    device = next(hf.parameters()).device
    ids = torch.zeros((1, 3), dtype=torch.int64, device=device)
    token = _STEP.set(_Step(None, None, probe))
    try:
        with torch.inference_mode():
            hf(input_ids=ids, position_ids=torch.arange(3, device=device)[None], use_cache=False)
    finally:
        _STEP.reset(token)
    name = type(hf).__name__
    if not probe.layers:
        raise refuse(f"cannot run {name}: its attention does not go through the interface")
    if probe.refusals:
        raise refuse(f"cannot run {name}: it {probe.refusals[0]}")
    layers = [i for i in probe.layers if i is not None]
    if sorted(layers) != list(range(len(probe.layers))):
        raise refuse(f"cannot run {name}: its attention layers have no distinct layer_idx")
    if len(probe.shapes) != 1:
        raise refuse(f"cannot run {name}: its layers' K/V shapes differ ({sorted(probe.shapes)})")
    ((kv_heads, k_dim, v_dim),) = probe.shapes
    if k_dim != v_dim:
        raise refuse(f"cannot run {name}: keys ({k_dim}) and values ({v_dim}) differ in size")
    text = config.get_text_config()
    width = int(getattr(text, "hidden_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or kv_heads)
    window = getattr(text, "sliding_window", None)
    eos = getattr(text, "eos_token_id", None)
    return ModelArchConfig(
        vocab_size=int(text.vocab_size),
        hidden_size=width,
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * width),
        num_layers=len(probe.layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=k_dim,
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 2048),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        sliding_window=window if isinstance(window, int) else None,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_ids=[]
        if eos is None
        else [int(e) for e in (eos if isinstance(eos, list) else [eos])],
        architecture=name,
    )
