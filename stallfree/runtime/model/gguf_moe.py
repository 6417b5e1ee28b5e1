"""GGUF mixture-of-experts files: llama.cpp's `llama` with expert tensors (Mixtral), `qwen2moe`
and `qwen3moe`.

llama.cpp stacks each layer's experts into one tensor per projection, `ffn_gate_exps`,
`ffn_up_exps` and `ffn_down_exps` ([experts, out, in] in torch's order), beside the router
`ffn_gate_inp`; Qwen2-MoE's shared expert is `ffn_{gate,up,down}_shexp` with its gate
`ffn_gate_inp_shexp` (a [hidden] vector). They are split back into the Hugging Face names of
moe.py's blocks, dequantised to float32 (the stacked blocks are not kept packed: quantization
`gguf` keeps the attention's and the output's, and the experts load dense).

The routing settings come from `{arch}.expert_count`, `expert_used_count`,
`expert_feed_forward_length` (Mixtral's experts are `feed_forward_length` wide),
`expert_shared_feed_forward_length` and `expert_weights_norm` (absent: renormalised for
Mixtral and Qwen3-MoE, not for Qwen2-MoE, as llama.cpp runs them); a layer without a router is
a dense layer (`mlp_only_layers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stallfree.runtime.model.moe_config import MoEConfig

if TYPE_CHECKING:
    import torch

    from stallfree.runtime.model.arch import ModelArchConfig

# llama.cpp family -> (MoEConfig style, Hugging Face architecture)
MOE_FAMILIES = {
    "llama": ("mixtral", "MixtralForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
ROUTER = "ffn_gate_inp.weight"
# stacked experts after "blk.N." -> which of MoEConfig.expert_names (gate, up, down)
EXPERT_TENSORS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
SHARED_TENSORS = {
    "ffn_gate_inp_shexp.weight": "shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "shared_expert.down_proj.weight",
}


def routed_layers(tensor_names: list[str]) -> set[int]:
    """The layers that have a router (`blk.N.ffn_gate_inp.weight`)."""
    return {
        int(name.split(".")[1])
        for name in tensor_names
        if name.startswith("blk.") and name.endswith("." + ROUTER)
    }


def gguf_moe_config(meta: Any, family: str, routed: set[int], num_layers: int) -> MoEConfig | None:
    """The MoE settings of a file (`meta`: gguf_families.Metadata), None for a dense one."""
    experts = int(meta.get(f"{family}.expert_count") or 0)
    if family not in MOE_FAMILIES or experts == 0 or not routed:
        return None
    style = MOE_FAMILIES[family][0]
    width = meta.get(f"{family}.expert_feed_forward_length")
    norm = meta.get(f"{family}.expert_weights_norm")
    shared = meta.get(f"{family}.expert_shared_feed_forward_length") or 0
    return MoEConfig(
        style=style,
        num_experts=experts,
        top_k=int(meta.require(f"{family}.expert_used_count")),
        expert_intermediate_size=int(width or meta.require(f"{family}.feed_forward_length")),
        norm_topk_prob=bool(norm) if norm is not None else style != "qwen2_moe",
        shared_expert_intermediate_size=int(shared) if style == "qwen2_moe" else 0,
        mlp_only_layers=tuple(i for i in range(num_layers) if i not in routed),
    )


def moe_architecture(moe: MoEConfig | None, default: str) -> str:
    if moe is None:
        return default
    return next(arch for style, arch in MOE_FAMILIES.values() if style == moe.style)


def is_moe_tensor(gguf_name: str) -> bool:
    rest = gguf_name.split(".", 2)[-1]
    return gguf_name.startswith("blk.") and (
        rest == ROUTER or rest in EXPERT_TENSORS or rest in SHARED_TENSORS
    )


def moe_tensors(
    gguf_name: str, weight: torch.Tensor, arch: ModelArchConfig
) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of one MoE tensor of a GGUF file (see `is_moe_tensor`)."""
    from stallfree.runtime.model.arch import ModelLoadError

    moe = arch.moe
    if moe is None:
        raise ModelLoadError(f"GGUF tensor {gguf_name}: expert tensors in a file with no experts")
    _, layer, rest = gguf_name.split(".", 2)
    block = f"model.layers.{int(layer)}.{moe.module_name}."
    if rest == ROUTER:
        return {block + "gate.weight": weight}
    if rest in SHARED_TENSORS:
        if rest == "ffn_gate_inp_shexp.weight":
            weight = weight.reshape(1, -1)  # HF's nn.Linear(hidden, 1)
        return {block + SHARED_TENSORS[rest]: weight}
    if weight.dim() != 3 or weight.shape[0] != moe.num_experts:
        raise ModelLoadError(
            f"GGUF tensor {gguf_name}: shape {list(weight.shape)}, expected "
            f"[{moe.num_experts}, out, in] stacked experts"
        )
    proj = moe.expert_names[EXPERT_TENSORS[rest]]
    return {f"{block}experts.{e}.{proj}.weight": weight[e].clone() for e in range(moe.num_experts)}
