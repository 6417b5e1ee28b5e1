"""Random PEFT LoRA adapters for the tiny test models, and the reference: transformers + peft
with the adapter merged into the weights."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from tests.hf_models import EOS_ID

# three adapters unlike each other: ranks, targets (one on every projection a fused q/k/v and
# gate/up stack), scaling (rsLoRA on one)
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "fused-r8": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
    },
    "mlp-r16-rs": {
        "r": 16,
        "lora_alpha": 4,
        "use_rslora": True,
        "target_modules": ["down_proj", "up_proj", "k_proj"],
    },
}


def make_adapter(base: str | Path, out: Path, seed: int = 0, **lora: Any) -> Path:
    """A PEFT adapter of `base` with random A and B (B is zero at PEFT's usual start), large
    enough that the greedy output changes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(str(out))
    return out


@functools.cache
def _merged(base: str, adapter: str) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def merged_greedy(
    base: str | Path, adapter: str | Path | None, prompt: list[int], n: int
) -> list[int]:
    """`n` greedy tokens of the base with `adapter` merged (None: the base alone)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if adapter is None:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    else:
        model = _merged(str(base), str(adapter))
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=EOS_ID
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return [int(t) for t in out[0, len(prompt) :]]
