"""The native CPU kernels' variants for tests: which this CPU has, a parametrize mark over
them, switching to one, and a fixture that puts the process back on the usual one."""

from __future__ import annotations

import pytest
import torch

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
