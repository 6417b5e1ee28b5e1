"""An integer schema's bounds, made ones llguidance constrains exactly, or refused.

llguidance reads a JSON schema's numbers as 64-bit floats and an integer range's ends as 64-bit
integers. A bound beyond 2^53 is rounded (`minimum: 9007199254740993` lets 9007199254740992
through), one beyond 2^63 is clamped (`minimum: 2^64, maximum: 2^64 + 3` produced
9223372036854775807), and a range at -2^63 crashed the process. So, for a schema whose `type`
is or includes "integer", with S = 2^53:

- a lower bound above S (from `minimum`, or `exclusiveMinimum`) or an upper bound below -S is
  refused (`IntegerBoundError`, a 400 naming the keyword): no integer the server can constrain
  exactly satisfies it;
- a lower bound below -S or an upper bound above S is taken as -S or S: the output still
  satisfies the schema, only its integers beyond ±S are never produced (a uint64 field's
  `maximum: 18446744073709551615` keeps working).

Bounds within ±S are left as written.
"""

from __future__ import annotations

import math
from typing import Any

SAFE = 2**53


class IntegerBoundError(ValueError):
    """An integer bound no value within ±2^53 satisfies."""


def exact_integer_bounds(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (one schema object, not its subschemas) with its integer bounds within ±2^53,
    or itself when they already are; raises `IntegerBoundError` for one that cannot be."""
    kind = schema.get("type")
    if not (kind == "integer" or (isinstance(kind, list) and "integer" in kind)):
        return schema
    lows, highs = _bounds(schema)
    for key, least in lows:
        if least > SAFE:
            raise _refused(key, schema[key], "above", SAFE)
    for key, greatest in highs:
        if greatest < -SAFE:
            raise _refused(key, schema[key], "below", -SAFE)
    low = max((v for _, v in lows), default=None)
    high = min((v for _, v in highs), default=None)
    if (low is None or low >= -SAFE) and (high is None or high <= SAFE):
        return schema
    out = {k: v for k, v in schema.items() if k not in _KEYS}
    if low is not None:
        out["minimum"] = int(max(low, -SAFE))
    if high is not None:
        out["maximum"] = int(min(high, SAFE))
    return out


_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _bounds(schema: dict[str, Any]) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The least integer each lower bound allows and the greatest each upper bound allows, by
    keyword (an infinite bound stays infinite)."""
    values = {key: schema[key] for key in _KEYS if _number(schema.get(key))}
    for key, value in values.items():
        if math.isnan(value):
            raise IntegerBoundError(f"the JSON schema's {key} is not a number")
    lows: list[tuple[str, float]] = []
    highs: list[tuple[str, float]] = []
    if "minimum" in values:  # draft 4 says `exclusiveMinimum: true` beside it
        m = values["minimum"]
        lows.append(
            ("minimum", _floor(m) + 1 if schema.get("exclusiveMinimum") is True else -_floor(-m))
        )
    if "exclusiveMinimum" in values:
        lows.append(("exclusiveMinimum", _floor(values["exclusiveMinimum"]) + 1))
    if "maximum" in values:
        m = values["maximum"]
        highs.append(
            ("maximum", -_floor(-m) - 1 if schema.get("exclusiveMaximum") is True else _floor(m))
        )
    if "exclusiveMaximum" in values:
        highs.append(("exclusiveMaximum", -_floor(-values["exclusiveMaximum"]) - 1))
    return lows, highs


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _floor(value: float) -> float:
    return value if math.isinf(value) else math.floor(value)


def _refused(key: str, value: Any, side: str, limit: int) -> IntegerBoundError:
    return IntegerBoundError(
        f"the JSON schema's {key} {value} allows only integers {side} {limit}: integer "
        "bounds are constrained exactly only between -2^53 and 2^53"
    )
