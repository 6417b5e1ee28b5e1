"""Render the configuration table for the README: `python -m stallfree.config.doc`."""

from __future__ import annotations

from pydantic import BaseModel

from stallfree.config.settings import StallfreeConfig


def config_table() -> str:
    rows = [
        "| setting | default | environment | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for section, field in StallfreeConfig.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for name, info in model.model_fields.items():
            default = info.get_default(call_default_factory=True)
            env = f"STALLFREE_{section.upper()}__{name.upper()}"
            rows.append(
                f"| `{section}.{name}` | `{default!r}` | `{env}` | {info.description or ''} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    print(config_table())
