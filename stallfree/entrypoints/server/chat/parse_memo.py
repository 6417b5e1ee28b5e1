"""What a streamed choice's tool-call parses keep from one piece of text to the next.

A stream's text only grows, so a JSON text that starts at a given offset of it is the same text
each time, longer. `ParseMemo` keeps, per such offset: how far a bracket scan has read (its
depth, whether it is inside a string), so each character is scanned once; the result of a
whole parse of a text of a given length, so a call that closed is parsed once; and the last
partial parse, redone only once the text has doubled (or grown by `STEP` characters), so the
partial parses of a call's arguments cost a small multiple of its length, not its square. A
partial parse that is not redone returns the last one: its arguments are a prefix of what is
to come, so a stream sends them a little later, never differently. Once `settled` (the text is
whole) every partial parse is fresh.

A text whose brackets are unbalanced cannot be JSON, and one nested deeper than `limit` is not
read: neither is handed to `json.loads` (a recursive parser) nor to `partial_json_parser`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

# a partial parse is redone after this many new characters at least (or once the text doubled)
STEP = 64


@dataclass(slots=True)
class BracketScan:
    """A bracket scan of a growing text, resumed where it stopped (`feed` the whole text)."""

    read: int = 0
    depth: int = 0
    deepest: int = 0
    quoted: bool = False
    escaped: bool = False
    first_close: int = -1  # the end of the first value whose brackets closed

    def feed(self, text: str) -> None:
        depth, deepest, quoted, escaped = self.depth, self.deepest, self.quoted, self.escaped
        for at in range(self.read, len(text)):
            char = text[at]
            if quoted:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    quoted = False
            elif char == '"':
                quoted = True
            elif char in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif char in "]}":
                depth -= 1
                if depth == 0 and self.first_close < 0:
                    self.first_close = at + 1
        self.read = max(self.read, len(text))
        self.depth, self.deepest, self.quoted, self.escaped = depth, deepest, quoted, escaped

    @property
    def balanced(self) -> bool:
        return self.depth == 0 and not self.quoted


@dataclass(slots=True)
class ParseMemo:
    limit: int
    settled: bool = False
    _scans: dict[Hashable, BracketScan] = field(default_factory=dict)
    _whole: dict[tuple[Hashable, int], Any] = field(default_factory=dict)
    _partial: dict[Hashable, tuple[int, Any]] = field(default_factory=dict)

    def scan(self, key: Hashable, text: str) -> BracketScan:
        scan = self._scans.get(key)
        if scan is None or len(text) < scan.read:  # not the text it scanned: start again
            scan = self._scans[key] = BracketScan()
        scan.feed(text)
        return scan

    def loads(self, key: Hashable, text: str) -> Any:
        """`json.loads(text)`, `text` starting at `key`; ValueError when it is not JSON, is
        nested too deep, or its brackets are still open."""
        scan = self.scan(key, text)
        if scan.deepest > self.limit:
            raise ValueError("nested too deep")
        if not scan.balanced:
            raise ValueError("brackets still open")
        done = self._whole.get((key, len(text)))
        if done is None:
            try:
                done = (True, json.loads(text))
            except ValueError as e:
                done = (False, e)
            self._whole[(key, len(text))] = done
        if not done[0]:
            raise ValueError(str(done[1]))
        return done[1]

    def partial(self, key: Hashable, text: str, parse: Callable[[str], Any]) -> Any:
        """`parse(text)` (a partial parse), `text` starting at `key`; None when it is nested too
        deep; the last such parse while `text` has not grown enough since."""
        if self.scan(key, text).deepest > self.limit:
            return None
        last = self._partial.get(key)
        if last is not None and not self.settled:
            size, value = last
            if size <= len(text) < max(2 * size, size + STEP):
                return value
        value = parse(text)
        self._partial[key] = (len(text), value)
        return value
