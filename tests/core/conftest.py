"""Fixtures shared by the tests in tests/core/ (the suite-wide ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from stallfree.config import SchedulerConfig
from stallfree.runtime.memory.radix_cache import RadixCache
from stallfree.runtime.scheduling.scheduler import Scheduler
from stallfree.runtime.telemetry.observer import EngineObserver
from stallfree.runtime.text.output_processor import OutputProcessor
from stallfree.runtime.text.tokenizer import ByteTokenizer


@pytest.fixture
def make_scheduler(batch_ctx: Callable[..., Any]) -> Callable[..., Scheduler]:
    """Builds a Scheduler driven by hand, on a model-free batch context from `batch_ctx` (so
    its stream is closed after the test). Sizes are `make_ctx`'s (`num_reqs` is also the
    running limit), `prefix_cache=True` gives it a RadixCache, other keywords are
    SchedulerConfig fields."""

    def build(
        *,
        num_tokens: int = 256,
        num_reqs: int = 8,
        max_context: int = 128,
        page_size: int = 1,
        prefix_cache: bool = False,
        **config: Any,
    ) -> Scheduler:
        ctx = batch_ctx(
            page_size=page_size, num_tokens=num_tokens, num_reqs=num_reqs, max_context=max_context
        )
        cache = None
        if prefix_cache:
            cache = RadixCache(ctx.allocator)
            ctx.allocator.evictor = cache
        output = OutputProcessor(ByteTokenizer(), EngineObserver())
        return Scheduler(
            config=SchedulerConfig(**config),
            ctx=ctx,
            max_running_requests=num_reqs,
            output=output,
            cache=cache,
        )

    return build
