"""Whether the rows a product sees are a decode step's (one per stream) or a prompt's.

The native kernels quantise an integer layer's activations and run a few rows on the AMX tiles;
both pay for a decode step of up to about 32 streams, where the alternative re-lays out or
dequantises the whole weight for a handful of rows. A prompt's rows are better served by the
dense product (its activations unquantised, oneDNN's blocking for many rows). The model's
forward says which it runs (`decode_rows`), and the layers ask (`in_decode`) when they choose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_DECODE: ContextVar[bool] = ContextVar("stallfree_decode_rows", default=False)


@contextlib.contextmanager
def decode_rows(on: bool = True) -> Iterator[None]:
    """Within (`on`): the rows the layers see are a decode step's."""
    token = _DECODE.set(on)
    try:
        yield
    finally:
        _DECODE.reset(token)


def in_decode() -> bool:
    return _DECODE.get()
