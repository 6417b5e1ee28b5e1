"""`MoEConfig`: a mixture-of-experts model's routing and expert shapes, parsed from a Hugging
Face config (Mixtral, Qwen2-MoE, Qwen3-MoE); the modules are in moe.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the architectures whose layers route tokens to experts, and the name of their HF config's style
MOE_STYLES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """`style` names the HF parameter layout: `mixtral` (`block_sparse_moe`, experts' w1/w2/w3,
    softmax weights kept in float32) or `qwen2_moe` / `qwen3_moe` (`mlp`, experts'
    gate/up/down_proj, weights cast back to the hidden dtype, an optional shared expert)."""

    style: str
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)

    @property
    def module_name(self) -> str:
        """The decoder layer's attribute (and HF name) of its MoE block."""
        return "block_sparse_moe" if self.style == "mixtral" else "mlp"

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """(gate, up, down) projection names of one expert."""
        return (
            ("w1", "w3", "w2") if self.style == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        )

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer `layer_id` routes to experts (transformers' rule); else a dense MLP."""
        if layer_id in self.mlp_only_layers:
            return False
        return self.num_experts > 0 and (layer_id + 1) % self.decoder_sparse_step == 0


def parse_moe(cfg: dict[str, Any], architecture: str) -> MoEConfig | None:
    """The MoE settings of an HF config, None for a dense architecture."""
    style = MOE_STYLES.get(architecture)
    if style is None:
        return None
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if style == "mixtral":
        return MoEConfig(
            style=style,
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            expert_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
        )
    return MoEConfig(
        style=style,
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok", 4 if style == "qwen2_moe" else 8)),
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        # transformers' default for both classes when a config omits it
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if style == "qwen2_moe"
        else 0,
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )
