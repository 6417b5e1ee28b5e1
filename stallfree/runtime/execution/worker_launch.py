"""Starting and stopping this node's worker processes (the host side of `worker.py`).

`start_workers` spawns one process per local tensor-parallel rank and, on node 0, waits until
every rank has loaded its shard and met the others (or says why one could not);
`run_worker_node` is a node other than 0, which only runs its ranks until the scheduler's node
stops them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from stallfree.config import StallfreeConfig
from stallfree.runtime.execution.worker import STAT_FIELDS, WorkerSpec, worker_main, worker_spec

READY_TIMEOUT_S = 600.0  # loading a large checkpoint on every rank takes a while


class WorkerStartError(RuntimeError):
    """A worker process could not start (its model did not load, the ranks did not meet)."""


def start_workers(spec: WorkerSpec) -> tuple[Connection | None, list[Any], torch.Tensor]:
    """Spawn this node's ranks. On node 0, returns the connection to rank 0 once every rank
    has loaded its shard and met the others; raises `WorkerStartError` if any could not."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ranks = spec.local_ranks()
    stats = torch.zeros((len(ranks), len(STAT_FIELDS)), dtype=torch.float64).share_memory_()  # type: ignore[no-untyped-call]
    parent: Connection | None = None
    processes = []
    for rank in ranks:
        child = None
        if rank == 0:
            parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=worker_main,
            args=(spec, rank, child, stats),
            name=f"stallfree-tp{rank}",
            daemon=True,
        )
        with _main_module_hidden():
            proc.start()
        processes.append(proc)
        if child is not None:
            child.close()
    if parent is not None:
        try:
            _await_ready(parent, processes)
        except BaseException:
            stop_processes(processes)
            raise
    return parent, processes, stats


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawn re-runs the parent's main script in the child unless it is guarded by
    `if __name__ == "__main__"`; the worker's entry point lives in `worker.py`, so the child
    needs nothing from `__main__`. Hide its file and spec while the child is prepared, so an
    embedding script without the guard works too."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    try:
        for key in saved:
            if key == "__spec__":
                main.__spec__ = None  # type: ignore[union-attr]
            else:
                delattr(main, key)
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


def _await_ready(conn: Connection, processes: list[Any]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    sentinels = {p.sentinel: p for p in processes}
    while time.monotonic() < deadline:
        for item in wait([conn, *sentinels], timeout=1.0):
            if item is conn:
                try:
                    kind, _, body = conn.recv()
                except EOFError:
                    raise WorkerStartError("the rank-0 worker exited while starting") from None
                if kind == "ready":
                    return
                raise WorkerStartError(f"a worker could not start: {body}")
            proc = sentinels[item]
            proc.join(timeout=5)
            raise WorkerStartError(
                f"worker {proc.name} exited with code {proc.exitcode} while starting"
            )
    raise WorkerStartError(f"workers did not start within {READY_TIMEOUT_S:.0f}s")


def stop_processes(processes: list[Any]) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2)


def run_worker_node(config: StallfreeConfig, max_context_len: int, num_kv_slots: int) -> int:
    """A node other than 0: run its ranks until they stop (the scheduler's node stops them)."""
    spec = worker_spec(config, num_kv_slots, max_context_len)
    _, processes, _ = start_workers(spec)
    codes = []
    for proc in processes:
        proc.join()
        codes.append(proc.exitcode or 0)
    return max(codes, default=0)
