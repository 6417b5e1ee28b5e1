"""Compiled grammars kept by what they hold in memory, least recently used first out.

llguidance does not say how large a compiled grammar is, so each entry is priced by an estimate
from its grammar text. Measured (RSS before and after compiling a grammar and computing its
first mask, which builds the lexer states the compiled grammar keeps): a JSON schema whose
`const` is 60,000 random letters (a grammar text of 60,145 characters) holds 37 MB with
Llama 3's 128,256-token vocabulary and 39 MB with SmolLM2's 49,152; a quarter of that const
holds 11 MB with either. That is 530 to 650 bytes a character, linear in the text and close to
flat in the vocabulary; an object of 1,200 named properties came to 377, large enums, choices
and regex alternations much less. So each entry is priced at `BYTES_PER_CHAR` times its text,
plus the text and its key: an upper bound for the grammars measured, and a cache of
`max_bytes` holds at most about that much of them.

An entry dropped from the cache stays valid for every request already holding a copy of it
(llguidance's copies share the compiled grammar by reference count), so eviction never ends a
running request; its memory goes when the last copy does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

# bytes a compiled grammar holds, per character of its grammar text (measured; see above)
BYTES_PER_CHAR = 640
DEFAULT_MAX_BYTES = 512 * 1024 * 1024

T = TypeVar("T")


def estimated_bytes(key: str, text: str) -> int:
    """What a compiled grammar of `text`, cached under `key`, is taken to hold."""
    return BYTES_PER_CHAR * len(text) + len(text) + len(key)


@dataclass(slots=True)
class _Entry(Generic[T]):
    value: T
    size: int


class GrammarCache(Generic[T]):
    """An LRU map from keys to compiled grammars whose estimated sizes sum to at most
    `max_bytes`. One entry larger than the whole cap is not kept at all."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0  # the estimated sizes of the entries held, summed
        self.evictions = 0
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """The keys held, least recently used first."""
        return list(self._entries)

    def get(self, key: str) -> T | None:
        """The entry under `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.value

    def put(self, key: str, value: T, text: str) -> None:
        """Keep `value` (compiled from grammar `text`) under `key`, dropping the least recently
        used entries until the sizes fit."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        size = estimated_bytes(key, text)
        if size > self.max_bytes:
            return
        self._entries[key] = _Entry(value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
            self.evictions += 1
