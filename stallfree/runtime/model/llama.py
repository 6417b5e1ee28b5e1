"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Phi-3) in plain torch, with HF
parameter names.

With a `TPGroup` of size > 1 each rank holds its shard of every split weight (same names, local
shapes; see parallel.py): q/k/v and gate/up are column-parallel (output slice), o and down are
row-parallel (input slice, then an all-reduce), the embedding and lm_head are vocab-parallel.
At size 1 the modules and the forward are those of the plain model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.runtime.model import native_layers, native_loop, native_prompt_loop
from stallfree.runtime.model.attention import PagedAttention
from stallfree.runtime.model.decode_rows import decode_rows
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.moe import add_mlp
from stallfree.runtime.model.parallel import (
    TPGroup,
    local_heads,
    local_kv_heads,
    padded_shard_len,
    shard_range,
)
from stallfree.runtime.model.quant import (
    GroupQuant,
    Int8Embedding,
    Int8Linear,
    QuantizedWeight,
    QuantLinear,
    fused_linear,
    make_linear,
    quantize_int8,
)
from stallfree.runtime.model.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from stallfree.runtime.model.arch import ModelArchConfig


class AttentionBackend(Protocol):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' arithmetic (float32 statistics, the weight applied in the input's
        # dtype) in one call: the native kernel, else torch's (equal bit for bit in float32)
        if native_layers.applies(x):
            return native_layers.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and _HAS_RMS_NORM:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = torch.rms_norm(h, h.shape[-1:], None, self.eps) if _HAS_RMS_NORM else _rms(h, self.eps)
        return self.weight * h.to(dtype)


_HAS_RMS_NORM = hasattr(torch, "rms_norm")  # torch >= 2.4


def _rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_id: int, tp: TPGroup, **factory: Any) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            local_heads(arch, tp),
            local_kv_heads(arch, tp),
            arch.head_dim,
        )
        hidden, q_out, kv_out = (
            arch.hidden_size,
            self.num_heads * arch.head_dim,
            self.num_kv_heads * arch.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_out, bias=arch.qkv_bias, **factory)
        self.k_proj = nn.Linear(hidden, kv_out, bias=arch.qkv_bias, **factory)
        self.v_proj = nn.Linear(hidden, kv_out, bias=arch.qkv_bias, **factory)
        self.o_proj = nn.Linear(q_out, hidden, bias=arch.o_bias, **factory)
        # Qwen3's per-head norms of q and k (replicated on every tensor-parallel rank); any
        # module over the last dimension (a subclass may put its own norm here)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, **factory)
        # q, k and v as one matmul (fuse_projections); None: three
        self.qkv_proj: nn.Module | None = None
        self.qkv_split = (q_out, kv_out, kv_out)

    def joint_qkv(self, h: torch.Tensor) -> torch.Tensor | None:
        """q, k and v side by side [T, (H + 2 KVH) * D] as one call makes them (a fused
        projection, or a grouped native call), or None when they are three calls."""
        if self.qkv_proj is not None:
            out: torch.Tensor = self.qkv_proj(h)
            return out
        return native_layers.grouped([self.q_proj, self.k_proj, self.v_proj], h)

    def project(
        self,
        h: torch.Tensor,
        cos: torch.Tensor | None,
        signed_sin: torch.Tensor | None,
        qkv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] with RoPE applied (not applied when `cos` is None: the
        attention backend applies it), and v [T, KVH, D]; `qkv`: `joint_qkv(h)` if made."""
        t = h.shape[0]
        if qkv is None:
            qkv = self.joint_qkv(h)
        if qkv is not None:
            q, k, v = qkv.split(self.qkv_split, dim=-1)  # type: ignore[no-untyped-call]
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is None or signed_sin is None:
            return q, k, v
        cos, signed_sin = self.layer_rope(cos, signed_sin)
        return apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin), v

    def layer_rope(
        self, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (cos, signed sin) out of the step's tables (a family with a table per
        layer kind picks its own)."""
        return cos, signed_sin

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        fb: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = h.shape[0]
        if getattr(backend, "takes_rope", False):
            # the backend rotates q and k itself (fused into its decode kernel)
            layer_rope = self.layer_rope(*rope)
            qkv = self.joint_qkv(h) if self.q_norm is None else None
            if qkv is not None and hasattr(backend, "forward_qkv"):
                # a decode step: q/k/v straight from the projection, out ready for o_proj
                joint = backend.forward_qkv(
                    qkv, self.num_heads, self.num_kv_heads, self.layer_id, fb, layer_rope
                )
                if joint is not None:
                    return self._output(joint)
            q, k, v = self.project(h, None, None, qkv)
            out = backend.forward(q, k, v, self.layer_id, fb, rope=layer_rope)  # type: ignore[call-arg]
        else:
            q, k, v = self.project(h, *rope)
            out = backend.forward(q, k, v, self.layer_id, fb)
        return self._output(out.reshape(t, self.num_heads * self.head_dim))

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads' outputs [T, H * D]."""
        if self.tp.size == 1:
            projected: torch.Tensor = self.o_proj(out)
            return projected
        return _row_parallel(self.o_proj, out, self.tp)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, tp: TPGroup, **factory: Any) -> None:
        super().__init__()
        self.tp = tp
        inter = padded_shard_len(arch.intermediate_size, tp.size)
        self.gate_proj = nn.Linear(arch.hidden_size, inter, bias=False, **factory)
        self.up_proj = nn.Linear(arch.hidden_size, inter, bias=False, **factory)
        self.down_proj = nn.Linear(inter, arch.hidden_size, bias=False, **factory)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one matmul
        self.inter = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.gate_up_proj is not None
            and self.tp.size == 1
            and (fused := native_layers.mlp_on_tiles(self.gate_up_proj, self.down_proj, x))
            is not None
        ):
            return fused
        if self.gate_up_proj is not None:
            x = native_layers.gate_up_silu(self.gate_up_proj, x)
        elif (gate_up := native_layers.grouped([self.gate_proj, self.up_proj], x)) is not None:
            x = native_layers.silu_mul(gate_up)
        elif (gate_up := native_layers.side_by_side([self.gate_proj, self.up_proj], x)) is not None:
            x = native_layers.silu_mul(gate_up)
        else:
            x = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if self.tp.size == 1:
            out: torch.Tensor = self.down_proj(x)
            return out
        return _row_parallel(self.down_proj, x, self.tp)


def _row_parallel(layer: nn.Linear | QuantLinear, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's partial product, summed over the ranks; the bias (replicated) added once."""
    # a quantized layer (quant.py) has its own matmul
    partial = F.linear(x, layer.weight) if isinstance(layer, nn.Linear) else layer.matmul(x)
    out = tp.all_reduce(partial)
    return out if layer.bias is None else out + layer.bias


class VocabParallelEmbedding(nn.Embedding):
    """The rank's contiguous vocabulary range; ids outside it embed to zero before the sum."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, **factory: Any) -> None:
        super().__init__(padded_shard_len(vocab_size, tp.size), hidden, **factory)
        self.tp = tp
        self.vocab_start, self.vocab_end = shard_range(vocab_size, tp.rank, tp.size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = (ids - self.vocab_start) * inside
        h = F.embedding(local, self.weight) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(h)


class LlamaDecoderLayer(nn.Module):
    mlp: nn.Module  # LlamaMLP, or moe.py's block on an MoE model's routed layers

    def __init__(self, arch: ModelArchConfig, layer_id: int, tp: TPGroup, **factory: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_id, tp, **factory)
        add_mlp(self, arch, layer_id, tp, LlamaMLP, **factory)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **factory)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        fb: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, fb, backend)
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out

    def fused_forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        fb: ForwardBatch,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the residual stream carried apart (vLLM's layout): `h` is the last
        block's output, not yet added; each add is fused into the RMSNorm that follows it.
        Returns (this layer's MLP output, the residual stream before it)."""
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, x = h, norm_in(h)
        else:
            residual, x = native_layers.add_rms_norm(residual, h, norm_in.weight, norm_in.eps)
        a = self.self_attn(x, rope, fb, backend)
        residual, x = native_layers.add_rms_norm(residual, a, norm_post.weight, norm_post.eps)
        return self.mlp(x), residual

    def split_forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        fb: ForwardBatch,
        backend: AttentionBackend,
        before: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        after: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """`forward` as (q, k, v) = before(...), attention, after(...): the two halves that
        `LlamaForCausalLM.compile_layers` compiles, with the paged attention left eager."""
        attn = self.self_attn
        q, k, v = before(self, h, rope[0], rope[1])
        out = backend.forward(q, k, v, attn.layer_id, fb)
        return after(self, h, out.reshape(h.shape[0], attn.num_heads * attn.head_dim))


class LlamaModel(nn.Module):
    # a family's own layers and final norm (gemma.py)
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, arch: ModelArchConfig, tp: TPGroup, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, **factory)
        else:
            self.embed_tokens = VocabParallelEmbedding(
                arch.vocab_size, arch.hidden_size, tp, **factory
            )
        self.layers = nn.ModuleList(
            self.layer_cls(arch, i, tp, **factory) for i in range(arch.num_layers)
        )
        self.norm = self.norm_cls(arch.hidden_size, arch.rms_norm_eps, **factory)
        self.rotary_emb = self.rotary(arch)

    @staticmethod
    def rotary(arch: ModelArchConfig) -> RotaryEmbedding:
        return RotaryEmbedding(arch)


class LlamaForCausalLM(nn.Module):
    """`forward(fb)` returns float32 logits [batch_size, vocab] for each request's last token.

    Layers call `self.attn_backend.forward(q, k, v, layer_id, fb)`; swap it to change attention.
    With a `TPGroup` of size > 1 every rank of the group must run the same forwards (each one
    holds its shard); every rank returns the same full logits.
    """

    model_cls: type[LlamaModel] = LlamaModel  # a family's own layers (gemma.py)

    def __init__(
        self,
        arch: ModelArchConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch  # the full model's shape; the rank's head counts are on its layers
        self.tp = tp = tp if tp is not None else TPGroup()
        factory = {"device": device, "dtype": dtype}
        self.model = self.model_cls(arch, tp, **factory)
        if not arch.tie_word_embeddings:
            vocab = padded_shard_len(arch.vocab_size, tp.size)
            self.lm_head = nn.Linear(arch.hidden_size, vocab, bias=False, **factory)
        self.attn_backend: AttentionBackend = PagedAttention(arch.sliding_window)
        # the int8 output matrix of a quantized model whose embedding is tied to it: it also
        # serves the embedding lookup (see quantize)
        self.tied_head: Int8Linear | None = None
        # the tied output matrix's compact form for decode rows (`compact_tied_head`)
        self.register_buffer("head_codes", None, persistent=False)
        self.register_buffer("head_tables", None, persistent=False)
        # whether every layer is a plain LlamaDecoderLayer (`_fuses_residual`); None: not asked
        self._plain_layers: bool | None = None
        # native_loop's plans per (rows, dtype, the backend's loop_facts) of a decode step
        self._loop_plans: dict[native_loop.PlanKey, native_loop.Plan | None] = {}
        # native_prompt_loop's plans the same way for a prompt (rows past the tiles' as one)
        self._prompt_plans: dict[native_loop.PlanKey, native_prompt_loop.Plan | None] = {}
        # compile_layers' two compiled halves of a decoder layer; None: eager
        self.compiled: tuple[Callable[..., Any], Callable[..., Any]] | None = None

    def lm_head_weight(self) -> torch.Tensor:
        """The rank's vocab rows of the output projection (all of them at tp size 1)."""
        if self.arch.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.mode is ForwardMode.IDLE or fb.batch_size == 0:
            device = self.model.norm.weight.device
            return torch.empty((0, self.arch.vocab_size), dtype=torch.float32, device=device)
        h = self.embed(fb.input_ids)
        rope = self.model.rotary_emb(fb.positions, h.dtype)
        # the output head's rows in a decode step are the step's too (`dense_max_rows`)
        with decode_rows(fb.mode is ForwardMode.DECODE):
            h = self._layers(h, rope, fb)
            last = (
                _last_tokens(h, fb) if fb.logit_rows is None else h.index_select(0, fb.logit_rows)
            )
            if fb.logit_positions is not None:
                last = torch.cat([last, h.index_select(0, fb.logit_positions)])
            logits = self._output(self.model.norm(last))
        if self.tp.size > 1:
            # each rank's vocab slice (the last one zero-padded), in rank order
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.arch.vocab_size]
        return logits.float()

    def _layers(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch
    ) -> torch.Tensor:
        """Every decoder layer over `h`: compiled halves, the fused loop (in C++ where it
        runs), or each layer's own forward."""
        backend = self.attn_backend
        if self.compiled is not None:
            before, after = self.compiled
            for layer in self.model.layers:
                h = cast(LlamaDecoderLayer, layer).split_forward(
                    h, rope, fb, backend, before, after
                )
        elif self._fuses_residual(h):
            residual: torch.Tensor | None = None
            looped = None
            if native_loop.enabled():
                layers = list(self.model.layers)
                looped = native_loop.run(layers, backend, h, rope, fb, self._loop_plans)
                if looped is None:
                    looped = native_prompt_loop.run(
                        layers, backend, h, rope, fb, self._prompt_plans
                    )
            if looped is not None:
                h, residual = looped
            else:
                for layer in self.model.layers:
                    h, residual = cast(LlamaDecoderLayer, layer).fused_forward(
                        h, residual, rope, fb, backend
                    )
            if residual is not None:
                h = residual + h
        else:
            for layer in self.model.layers:
                h = layer(h, rope, fb, backend)
        return h

    def _fuses_residual(self, h: torch.Tensor) -> bool:
        """Whether the layers run `fused_forward`: plain Llama-family layers (their norms
        `RMSNorm` itself, not a family's own) with the native kernels on for `h`."""
        if not native_layers.applies(h):
            return False
        if self._plain_layers is None:
            self._plain_layers = all(
                type(layer) is LlamaDecoderLayer
                and type(layer.input_layernorm) is RMSNorm
                and type(layer.post_attention_layernorm) is RMSNorm
                for layer in self.model.layers
            )
        return self._plain_layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tied_head is not None:
            return self.tied_head.embed(ids)
        out: torch.Tensor = self.model.embed_tokens(ids)
        return out

    def compile_layers(self) -> None:
        """torch.compile the decoder layers' work around attention (inductor on the CPU), in
        two graphs shared by every layer: RMSNorm, q/k/v and RoPE before; o_proj, residual,
        RMSNorm, MLP and residual after. The token count is dynamic, so one graph serves every
        batch size (size 1 is specialised by torch: a second graph). The caller warms it up
        (`compile.warm_up`); the first call of each size compiles."""
        if self.tp.size > 1:
            raise ValueError("torch_compile supports tensor-parallel size 1 only")
        self.compiled = (
            torch.compile(_before_attention, dynamic=True),
            torch.compile(_after_attention, dynamic=True),
        )

    def fuse_projections(self, packed: dict[str, QuantizedWeight] | None = None) -> int:
        """One matmul for q/k/v and one for gate/up in every layer, in place; returns how many
        were fused.

        At small batch each projection is a matrix-vector product whose fixed cost rivals its
        reading (SmolLM2's k_proj, a third of q_proj's weights, takes 87% of its time), so one
        call over the stacked weights does the three in little more than one. The stacked
        weight sums in another order than three matmuls, so float32 models that must equal
        transformers' bit for bit are not fused (loader.py decides). Weights in `packed`
        (quantized, possibly on the meta device here) are stacked there, under the fused name;
        a group mixing packed and dense weights stays as it is, and one already stacked too.
        """
        packed = packed if packed is not None else {}
        fused = 0
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            base = f"model.layers.{i}."
            qkv = None
            if attn.qkv_proj is None:
                parts = [attn.q_proj, attn.k_proj, attn.v_proj]
                qkv = fused_linear(parts, base + "self_attn.", "qkv_proj", packed)
            if qkv is not None:
                attn.qkv_proj = qkv
                del attn.q_proj, attn.k_proj, attn.v_proj
                fused += 1
            # an MoE block's experts stay unfused (moe.py)
            if not isinstance(mlp, LlamaMLP) or mlp.gate_up_proj is not None:
                continue
            gate_up = fused_linear(
                [mlp.gate_proj, mlp.up_proj], base + "mlp.", "gate_up_proj", packed
            )
            if gate_up is not None:
                mlp.gate_up_proj = gate_up
                del mlp.gate_proj, mlp.up_proj
                fused += 1
        return fused

    def quantize(
        self,
        method: str,
        dtype: torch.dtype,
        packed: dict[str, QuantizedWeight] | None = None,
    ) -> dict[str, nn.Module]:
        """Swap the linear layers for quantized ones (quant.py), in place; returns them by name.

        `packed` holds weights that come quantized (a GGUF file's blocks, by Hugging Face
        name), taken out of it as they are used: they keep their form under any method but
        `none`, and this model's own weights
        for those names may be on the meta device. Under `int8` / `int4` every other linear
        weight is quantized from its float values. The output matrix is int8 under `int4`
        (logits are the most sensitive product); a tied one also serves the embedding lookup
        (a tensor-parallel model keeps a tied output matrix dense).
        """
        packed = packed if packed is not None else {}
        swapped: dict[str, nn.Module] = {}
        # each packed weight leaves `packed` as its layer is built, so a layer that re-lays
        # its codes out (quant.rows_in_lanes) frees the file's order as it goes (kept to the
        # end, the 1B Q8_0 model's load peaked 974 MB higher)
        for name, module in list(self.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            weight: torch.Tensor | QuantizedWeight | None = packed.pop(f"{name}.weight", None)
            if weight is None:
                if method in ("none", "gguf"):
                    continue
                weight = module.weight.detach()
            layer_method = "int8" if name == "lm_head" and method == "int4" else method
            layer = make_linear(weight, module.bias, layer_method, dtype)
            if layer is not None:
                self.set_submodule(name, layer)
                swapped[name] = layer
        if self.arch.tie_word_embeddings and self.tp.size == 1:
            tied = packed.pop("model.embed_tokens.weight", None)
            if tied is None and method in ("int8", "int4"):
                tied = quantize_int8(self.model.embed_tokens.weight.detach())
            if isinstance(tied, GroupQuant):
                tied = quantize_int8(tied.dequantize())
            if tied is not None:
                head = Int8Linear(tied, None, dtype)
                self.tied_head = head
                self.model.embed_tokens = Int8Embedding(head)  # type: ignore[assignment]
                swapped["lm_head"] = head
        return swapped

    def compact_tied_head(self) -> bool:
        """`--compact-decode-weights` for an output matrix tied to the embedding (no nn.Linear
        of its own): its compact form beside it, which `_output` multiplies for decode rows.
        Returns whether it has one."""
        # (a quantized tied embedding, Int8Embedding, has no dense weight at all)
        weight = getattr(self.model.embed_tokens, "weight", None)
        if not (
            self.arch.tie_word_embeddings
            and self.tied_head is None
            and isinstance(weight, torch.Tensor)
            and native_layers.compact_applies(weight)
        ):
            return False
        self.head_codes, self.head_tables = torch.ops.stallfree.compact_bf16(weight.detach())
        return True

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        if self.tied_head is not None:
            return self.tied_head.matmul(x)
        if self.arch.tie_word_embeddings:
            compact = None if self.head_codes is None else (self.head_codes, self.head_tables)
            return native_layers.linear(x, self.model.embed_tokens.weight, compact=compact)
        out: torch.Tensor = self.lm_head(x)
        return out


def _before_attention(
    layer: LlamaDecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.self_attn.project(layer.input_layernorm(h), cos, sin)


def _after_attention(layer: LlamaDecoderLayer, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    h = h + layer.self_attn.o_proj(out)
    after: torch.Tensor = h + layer.mlp(layer.post_attention_layernorm(h))
    return after


def _last_tokens(h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """Rows of each request's last token, sliced with host offsets (no index tensor upload)."""
    if fb.mode in (ForwardMode.DECODE, ForwardMode.VERIFY) or all(
        n == 1 for n in fb.extend_lens_cpu
    ):
        return h  # a verify step scores every position
    ends = []
    total = 0
    for n in fb.extend_lens_cpu:
        total += n
        ends.append(total)
    return torch.stack([h[e - 1] for e in ends])
