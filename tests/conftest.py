from __future__ import annotations

import os

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on uvloop, the loop stallfree serves on."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}
