"""Processes below a test's servers and workers, read from psutil when installed, else from
/proc: what is left running after a server stops or is killed."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        found, todo = set(), [pid]
        while todo:
            for child in children.get(todo.pop(), []):
                found.add(child)
                todo.append(child)
        return found
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def running(pid: int, proc: Path = Path("/proc")) -> bool:
    """Alive and not a zombie; the multiprocessing resource tracker does not count (it outlives
    the workers by design and holds no model). A process whose command line reads empty is
    exiting: its memory is already released (the tracker reads so for a moment after its
    parent exits, before it turns zombie)."""
    try:
        state = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / str(pid) / "cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X") and cmdline != b"" and b"resource_tracker" not in cmdline


def leave_group() -> None:
    """End a test's gloo rank that finished its work: meet the other ranks, then exit 0 without
    tearing the process group down. A teardown can abort the process (SIGABRT, "terminate
    called without an active exception") when a peer, the store's host among them, has already
    gone; the results are saved by then, so nothing is lost by leaving at once."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
