"""The tests' own judge of "left running" (tests/process_util.py), read from a fake /proc."""

from __future__ import annotations

from pathlib import Path

from tests.process_util import running


def _proc(root: Path, pid: int, state: str, cmdline: bytes) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(f"{pid} (python3) {state} 1 {pid} {pid} 0 -1\n")
    (root / str(pid) / "cmdline").write_bytes(cmdline)


def test_running_counts_live_workers_only(tmp_path: Path) -> None:
    worker = b"python\0-c\0from multiprocessing.spawn import spawn_main\0"
    tracker = b"python\0-c\0from multiprocessing.resource_tracker import main;main(5)\0"
    _proc(tmp_path, 10, "S", worker)
    _proc(tmp_path, 11, "R", worker)
    _proc(tmp_path, 12, "Z", b"")  # a zombie: exited, not yet reaped
    _proc(tmp_path, 13, "S", tracker)  # outlives the workers by design
    # exiting: its memory is released, so the command line reads empty, yet the state is not
    # Z for a moment (the resource tracker read so right after its parent exited)
    _proc(tmp_path, 14, "R", b"")
    _proc(tmp_path, 15, "D", b"")
    assert [pid for pid in range(10, 17) if running(pid, tmp_path)] == [10, 11]
