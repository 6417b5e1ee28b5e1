from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The debug checks are on for the whole suite: mirror parity after every batch operation and
# the future map's stash stamps. A test that measures the production path turns them off in
# its own config (`runtime.check_mirrors=false`), which wins over the environment.
os.environ.setdefault("STALLFREE_RUNTIME__CHECK_MIRRORS", "true")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on uvloop, the loop stallfree serves on."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama (`hf_models.make_llama` defaults, seed 0), written once per run.

    Read-only: a test that needs a changed copy copies it (or writes its own variant)."""
    from tests.hf_models import make_llama

    return str(make_llama(tmp_path_factory.mktemp("llama")))
