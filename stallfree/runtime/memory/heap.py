"""Handing the C heap's free memory back to the system after a load.

Loading a model makes many short-lived tensors of a few MB each. glibc raises its mmap
threshold as large blocks are freed, so later blocks of that size come from the heap, and
freed heap memory stays in the process: SmolLM2's Q8_0 file left about 350 MB of it resident
on top of 130 MB of weights. `malloc_trim(0)` gives those pages back. Elsewhere (another C
library, another system) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; whether the C library could."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
