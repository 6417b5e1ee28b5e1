"""What a structured-output request asks for: one JSON schema, regex, choice list or grammar.

The fields are vLLM's `StructuredOutputsParams` (`json`, `regex`, `choice`, `grammar`,
`json_object`); the HTTP front end maps OpenAI's `response_format`, vLLM's older `guided_*`
fields and SGLang's `json_schema` / `regex` / `ebnf` onto it. Exactly one is set. Sizes are
bounded here, so one client cannot pin memory or compile time with a megabyte-long schema;
`runtime/text/grammar_compiler.py` turns the spec into an llguidance grammar and compiles it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_GRAMMAR_CHARS = 64 * 1024  # a serialized schema, a regex or a grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(
        None,
        alias="json",
        description="A JSON schema (an object, or its JSON text) the output must validate against",
    )
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS, description="A regex (Rust's)")
    choice: list[str] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES, description="The output is one of these"
    )
    grammar: str | None = Field(
        None,
        max_length=MAX_GRAMMAR_CHARS,
        description="A Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's)",
    )
    json_object: bool = Field(False, description="Any JSON object")
    # the client's field this came from, which a compile error names (not part of the spec)
    source: str = Field("structured_outputs", exclude=True, max_length=64)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        set_ = [n for n in ("json", "regex", "choice", "grammar") if self._value(n) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, regex, choice, grammar and "
                f"json_object (got {', '.join(set_) or 'none'})"
            )
        if self.json_schema is not None:
            text = self.schema_text
            if len(text) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"the JSON schema is over {MAX_GRAMMAR_CHARS} characters")
        for c in self.choice or ():
            if len(c) > MAX_CHOICE_CHARS:
                raise ValueError(f"choices must be at most {MAX_CHOICE_CHARS} characters")
        return self

    def _value(self, name: str) -> object:
        return self.json_schema if name == "json" else getattr(self, name)

    @property
    def kind(self) -> str:
        """The one field set: `json`, `regex`, `choice`, `grammar` or `json_object`."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if self._value(n) is not None)

    @property
    def schema_text(self) -> str:
        """The JSON schema as compact text, its keys in the order written (the order of
        `properties` is the order a reply writes them, as OpenAI's and vLLM's are); the
        compiled-grammar cache's key."""
        schema = self.json_schema
        if isinstance(schema, str):
            return schema
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
