"""Render the configuration table for the README: `python -m stallfree.config.doc`."""

from __future__ import annotations

from stallfree.config.settings import StallfreeConfig


def config_table() -> str:
    rows = [
        "| setting | default | environment | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for section, field in StallfreeConfig.model_fields.items():
        model = field.default_factory
        assert model is not None
        for name, info in model.model_fields.items():  # type: ignore[attr-defined]
            default = info.default if info.default_factory is None else info.default_factory()
            env = f"STALLFREE_{section.upper()}__{name.upper()}"
            rows.append(
                f"| `{section}.{name}` | `{default!r}` | `{env}` | {info.description or ''} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    print(config_table())
