"""The CPU stream is the process's one OpenMP team: the thread that hands it work gives up its
own pool of OpenMP workers (omp_pool.py). With a second pool alive, libgomp counts more
threads than cores, stops spinning between parallel regions, and every region of a decode step
on the stream paid a futex wake (an engine's time per token was 2.4x its forward's)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from stallfree.overlap import omp_pool
from stallfree.overlap.stream import CpuStream

LIB = omp_pool._loaded_runtime()
pytestmark = pytest.mark.skipif(LIB is None, reason="no OpenMP runtime in this torch")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_threads(at_most: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while _threads() > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads()


def test_the_runtime_found_is_torchs() -> None:
    assert LIB is not None
    torch_dir = str(Path(torch.__file__).parent)
    name = Path(LIB._name).name
    assert LIB._name.startswith(torch_dir) or name in ("libgomp.so.1", "libomp.so")


def test_handing_work_to_the_stream_frees_the_callers_pool() -> None:
    """Run in a thread of its own, so the test runner's main thread keeps its settings."""
    result: dict[str, int] = {}

    def caller() -> None:
        assert LIB is not None
        torch.set_num_threads(2)
        torch.ones(8_000_000).sum()  # this thread now has a pool of OpenMP workers
        result["with_pool"] = _threads()
        stream = CpuStream(num_threads=2)
        try:
            result["with_stream"] = _threads()
            done = []
            stream.submit(lambda: done.append(torch.ones(8_000_000).sum()))
            stream.synchronize()
            assert done
            result["max_threads_after"] = LIB.omp_get_max_threads()
            # the stream's region adds its worker; the caller's worker exits
            result["after"] = _wait_threads(result["with_stream"])
        finally:
            stream.close()

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no OpenMP workers to free")
    t = threading.Thread(target=caller)
    t.start()
    t.join()
    assert result["max_threads_after"] == 1  # the caller's regions now run on itself alone
    assert result["after"] <= result["with_stream"], result  # without the release: one more
