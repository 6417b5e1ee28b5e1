"""The native CPU kernels' variants for tests: which this CPU has, a parametrize mark over
them, switching to one (tests/model/conftest.py has the fixtures that put the process back
and turn the AMX tiles on), a mark for tests that need the tiles, and a recorder of the ops a
piece of code calls, and a backend changed after a first step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stallfree.runtime.model import cpu_kernels


def variants() -> list[str]:
    """The instruction-set variants this CPU runs ('avx512', 'avx2'), best first."""
    found = []
    for isa in ("avx512", "avx2"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STALLFREE_CPU_ISA", isa)
            cpu_kernels.reset()
            if cpu_kernels.isa() == isa:
                found.append(isa)
    cpu_kernels.reset()
    return found


VARIANTS = variants()
needs_kernels = pytest.mark.skipif(not VARIANTS, reason="native CPU kernels unavailable here")
each_isa = pytest.mark.parametrize("isa", VARIANTS)


def set_isa(isa: str) -> None:
    assert torch.ops.stallfree.set_isa(isa) == isa


needs_amx = pytest.mark.skipif(
    "avx512" not in VARIANTS or not cpu_kernels.amx(),
    reason="no AMX tiles in use (none granted here, or the environment chose otherwise)",
)


class OpCalls(TorchDispatchMode):
    """Every op called inside the `with` block, by name ("aten.addmm", "stallfree.linear"), in
    order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def native(self) -> list[str]:
        """The stallfree ops among them, in order."""
        return [name for name in self.calls if name.startswith("stallfree.")]


def window_then_cap(backend: Any) -> Iterator[None]:
    """A windowed `PagedAttention` changed after a model's first step, as a caller may change
    it: its window turned off, then a soft-cap set (Gemma 2's kind, low enough to bite on
    random scores); the loop runs once after each change."""
    backend.sliding_window = None
    yield
    backend.softcap = 8.0
    yield
