"""Fixtures shared by the tests in tests/model/ (the suite-wide ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from stallfree.runtime.model import cpu_kernels


@pytest.fixture
def restore_variant() -> Iterator[None]:
    """A test that switches the native kernels' variant (native_util.set_isa) or the AMX tiles
    leaves the process on the usual ones."""
    yield
    usual = cpu_kernels.isa()
    if usual is not None:
        torch.ops.stallfree.set_isa(usual)
        # a variant starts without the tiles: back on where the process uses them, so the
        # layers that route by `cpu_kernels.amx()` find them
        torch.ops.stallfree.set_amx(cpu_kernels.amx())


@pytest.fixture
def tiles(restore_variant: None) -> Iterator[None]:
    """The AVX-512 variant with the AMX tiles on (tests marked native_util.needs_amx); the usual
    state afterwards (set once for all of a property test's examples, which only read it)."""
    torch.ops.stallfree.set_isa("avx512")
    assert torch.ops.stallfree.set_amx(True)
    yield
    torch.ops.stallfree.set_amx(cpu_kernels.amx())
