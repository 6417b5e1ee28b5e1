"""LoRA adapters served beside the base model (vLLM's `--enable-lora` family of settings)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from stallfree.config.sections import Section


class LoraModule(Section):
    """One adapter to load at start: the name requests pick it by (their `model` field) and
    its PEFT directory; `base_model_name`, if given, must name the served base model."""

    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1)
    base_model_name: str | None = None


class LoraConfig(Section):
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters; a request picks one by name (its model field over HTTP)",
    )
    lora_modules: list[LoraModule] = Field(
        default_factory=list, description="Adapters loaded at start (name and PEFT directory)"
    )
    max_loras: int = Field(
        4, ge=1, le=64, description="Adapters resident at once: the slots a batch's rows use"
    )
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="The largest adapter rank a slot holds"
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="Adapters whose weights stay in host memory; a request for another reads "
        "its checkpoint again; default: max_loras",
    )

    @model_validator(mode="before")
    @classmethod
    def _modules_enable(cls, data: Any) -> Any:
        # naming adapters to load is asking for LoRA, as vLLM takes it
        if isinstance(data, dict) and data.get("lora_modules") and "enable_lora" not in data:
            data = {**data, "enable_lora": True}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> LoraConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"lora.max_cpu_loras ({self.max_cpu_loras}) must be at least lora.max_loras "
                f"({self.max_loras})"
            )
        names = [m.name for m in self.lora_modules]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"lora.lora_modules names {', '.join(twice)} more than once")
        return self

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
