"""Fixtures shared by the tests in tests/serving/ (the suite-wide ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from tests.http_util import warnings_logged
from tests.server_util import Live, serving


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(llama: str) -> AsyncIterator[Live]:
    """One server on the suite's Llama per test module; its tests run on the module's loop
    (mark them `tests.server_util.module_loop`)."""
    async with serving(llama) as server:
        yield server


@pytest.fixture
def log_records() -> Iterator[list]:
    """Every record of WARNING or above that the test logs, from every logger."""
    with warnings_logged() as records:
        yield records
