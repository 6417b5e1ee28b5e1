"""Regex shorthand classes in their ASCII meaning: `\\d` is `[0-9]`, as clients expect.

llguidance reads a regex with Rust's syntax, where `\\d`, `\\w` and `\\s` are Unicode classes
(`\\d` matches U+1FBF8 and every other decimal digit). Clients write them meaning ASCII, as
JavaScript, Python's `re.ASCII` and vLLM's default backend read them, so a reply to
`\\d{4}-\\d{2}` is a year and a month. `ascii_classes` rewrites the six shorthands (and their
negations) outside and inside bracket classes; every other escape, class and character is kept
as written. The rewrite is idempotent: its output has no shorthand left.
"""

from __future__ import annotations

# the members of each class, in the syntax that fits inside brackets
_MEMBERS = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\x0B\\x0C\\r "}


def _outside(letter: str) -> str:
    members = _MEMBERS[letter.lower()]
    return f"[^{members}]" if letter.isupper() else f"[{members}]"


def _inside(letter: str) -> str:
    members = _MEMBERS[letter.lower()]
    # a negated shorthand inside brackets is a nested class (Rust's `[[^0-9].]`)
    return f"[^{members}]" if letter.isupper() else members


def ascii_classes(pattern: str) -> str:
    """`pattern` with `\\d \\w \\s \\D \\W \\S` in their ASCII forms (see the module)."""
    out: list[str] = []
    depth = 0  # bracket classes open at this point
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            if i + 1 >= n:  # a trailing backslash: the backend reports it
                out.append(ch)
                break
            nxt = pattern[i + 1]
            if nxt in "dDwWsS":
                out.append(_inside(nxt) if depth else _outside(nxt))
            else:
                out.append(ch + nxt)  # any other escape stays whole (`\\\\`, `\\]`, `\\p`)
            i += 2
            continue
        if ch == "[":
            if depth and pattern.startswith("[:", i):
                end = pattern.find(":]", i + 2)
                if end != -1:  # an ASCII class such as [:alpha:], already ASCII
                    out.append(pattern[i : end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(ch)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":  # a `]` first in a class is a literal
                out.append("]")
                i += 1
            continue
        if ch == "]" and depth:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)
