from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The debug checks are on for the whole suite: mirror parity after every batch operation and
# the future map's stash stamps. A test that measures the production path turns them off in
# its own config (`runtime.check_mirrors=false`), which wins over the environment.
os.environ.setdefault("STALLFREE_RUNTIME__CHECK_MIRRORS", "true")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

if TYPE_CHECKING:
    from stallfree.overlap.stream import CpuStream
    from stallfree.runtime.execution.context import BatchContext


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on uvloop, the loop stallfree serves on."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(autouse=True)
def logging_restored() -> Iterator[None]:
    """The loggers a server configures, as they were before each test: `configure_logging`
    (a server or replicas front started in the test's process) stops the `stallfree` loggers'
    propagation and gives them a handler on that test's captured stderr, which later tests'
    caplog and log lines would otherwise meet (no records, or a closed file)."""
    import logging

    names = ["stallfree", "stallfree.router", "uvicorn", "uvicorn.error", "uvicorn.access"]
    loggers = [logging.getLogger(name) for name in names]
    saved = [(lg.handlers[:], lg.propagate, lg.level, lg.disabled) for lg in loggers]
    try:
        yield
    finally:
        for lg, (handlers, propagate, level, disabled) in zip(loggers, saved, strict=True):
            lg.handlers[:] = handlers
            lg.propagate, lg.level, lg.disabled = propagate, level, disabled


@pytest.fixture(scope="session", autouse=True)
def gguf_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """GGUF start-up cache entries (gguf_cache.py) go to the run's own directory, not the
    user's ~/.cache: a run parses each file once, then hits, as a server's restarts do."""
    directory = str(tmp_path_factory.mktemp("gguf-cache"))
    before = os.environ.get("STALLFREE_CACHE_DIR")
    os.environ["STALLFREE_CACHE_DIR"] = directory
    yield directory
    if before is None:
        os.environ.pop("STALLFREE_CACHE_DIR", None)
    else:
        os.environ["STALLFREE_CACHE_DIR"] = before


@pytest.fixture
def float32_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model keeps q/k/v and gate/up apart, transformers' layout, on any CPU (one not
    Intel's stacks them where the native kernels are built: native_layers.stacks_float32)."""
    from stallfree.runtime.model import native_layers

    monkeypatch.setattr(native_layers, "stacks_float32", lambda device: False)


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama (`hf_models.make_llama` defaults, seed 0), written once per run.

    Read-only: a test that needs a changed copy copies it (or writes its own variant)."""
    from tests.hf_models import make_llama

    return str(make_llama(tmp_path_factory.mktemp("llama")))


@pytest.fixture
def batch_ctx() -> Iterator[Callable[..., BatchContext]]:
    """Builds model-free batch contexts (`batch_harness.make_ctx`'s arguments). Every one's
    stream is closed after the test, pass or fail, so a failed assert leaks no worker thread."""
    from tests.batch_harness import make_ctx

    made: list[BatchContext] = []

    def build(**kwargs: Any) -> BatchContext:
        ctx = make_ctx(**kwargs)
        made.append(ctx)
        return ctx

    try:
        yield build
    finally:
        for ctx in made:
            ctx.stream.close()


@pytest.fixture
def cpu_stream() -> Iterator[CpuStream]:
    """A CPU stream, closed after the test, pass or fail."""
    from stallfree.overlap.stream import CpuStream

    stream = CpuStream()
    try:
        yield stream
    finally:
        stream.close()
