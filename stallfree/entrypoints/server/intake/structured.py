"""The spellings of a structured-output request, mapped onto `SamplingParams.structured_outputs`.

- OpenAI: `response_format` `{"type": "json_object"}` or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`;
- vLLM: `structured_outputs: {json, regex, choice, grammar, json_object}`, and the older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- SGLang's `/generate`: `sampling_params.json_schema` (the schema's JSON text), `regex`, `ebnf`.

A request sets at most one of them; the spec remembers which (`source`), so a schema that
does not compile is a 400 naming the field the client wrote.
"""

from __future__ import annotations

from typing import Any

from stallfree.entrypoints.server.base.errors import ApiError

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_SGLANG = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "response_format must be an object", param="response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema",
            )
        return {"json": schema}
    raise ApiError(
        400,
        f"response_format.type must be text, json_object or json_schema, not {str(kind)[:40]!r}",
        param="response_format.type",
    )


def _one(found: list[tuple[str, dict[str, Any]]]) -> dict[str, Any] | None:
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(
            400,
            f"set one structured-output field, not several ({names})",
            param=found[1][0],
        )
    source, spec = found[0]
    return {**spec, "source": source}


def openai_structured(body: Any) -> dict[str, Any] | None:
    """The one spec of a `/v1` request (a `SamplingParams.structured_outputs` value), or None."""
    found: list[tuple[str, dict[str, Any]]] = []
    spec = _response_format(body.response_format)
    if spec is not None:
        found.append(("response_format", spec))
    if body.structured_outputs is not None:
        value = body.structured_outputs
        if not isinstance(value, dict):
            raise ApiError(400, "structured_outputs must be an object", param="structured_outputs")
        found.append(("structured_outputs", dict(value)))
    for name, key in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, {key: value}))
    return _one(found)


def native_structured(fields: dict[str, Any]) -> dict[str, Any]:
    """`/generate`'s `sampling_params` with SGLang's `json_schema` / `regex` / `ebnf` moved
    into `structured_outputs`."""
    if not any(name in fields for name in _SGLANG):
        return fields
    fields = dict(fields)
    found = [
        (f"sampling_params.{name}", {key: fields.pop(name)})
        for name, key in _SGLANG.items()
        if name in fields
    ]
    found = [(name, spec) for name, spec in found if next(iter(spec.values())) is not None]
    if "structured_outputs" in fields and fields["structured_outputs"] is not None:
        found.insert(0, ("sampling_params.structured_outputs", fields["structured_outputs"]))
    spec = _one(found)
    if spec is not None:
        fields["structured_outputs"] = spec
    return fields
