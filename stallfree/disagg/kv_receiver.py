"""The decode side's gloo receiver, in a process of its own.

gloo aborts its whole process (SIGABRT, from its I/O thread) when a peer sends more bytes than
the receive posted for them, or sends where no receive was posted. A prefill peer, buggy or
hostile, must fail only its own pair, so on the decode side the pair's group lives in a child
process (`python -m stallfree.disagg.kv_receiver`): the server asks it for one piece of at most
`CHUNK_BYTES` at a time into a slot of memory the two share (a memfd), and copies each piece out.
When the child dies, its pair breaks (`TransportError`) and the server goes on; the next request
pairs anew.

The server talks to the child over its stdin and stdout, in fixed binary frames (no pickle):
first one JSON line of settings; then `<slot, bytes>` commands, each answered by `D<slot>` once
received, `E<len><text>` when the receive failed, or `R` once, when the group has formed.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
from typing import IO, Any

import torch

from stallfree.disagg.transport import TransportError

CHUNK_BYTES = 4 << 20  # the largest single message on a pair's group (dist.py sends in these)
SLOTS = 4
_COMMAND = struct.Struct("<IQ")  # slot, bytes
_SLOT = struct.Struct("<I")
_LEN = struct.Struct("<I")
READY, DONE, ERROR = b"R", b"D", b"E"


def chunks(nbytes: int) -> list[tuple[int, int]]:
    """(offset, bytes) of each message a tensor of `nbytes` travels as."""
    return [(off, min(CHUNK_BYTES, nbytes - off)) for off in range(0, nbytes, CHUNK_BYTES)]


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = stream.read(n - len(data))
        if not part:
            break
        data += part
    return data


class ProcessChannel:
    """The receiving end of a pair, its gloo group in a child process (see the module)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        fd = os.memfd_create("stallfree-kv")
        try:
            os.ftruncate(fd, SLOTS * CHUNK_BYTES)
            self._map = mmap.mmap(fd, SLOTS * CHUNK_BYTES)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "stallfree.disagg.kv_receiver"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(fd,),
                bufsize=0,
            )
        finally:
            os.close(fd)
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8)
        self._lock = threading.Lock()
        self._closed = False
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to, self._from = self._proc.stdin, self._proc.stdout
        try:
            line = json.dumps({**settings, "fd": fd, "parent": os.getpid()})
            self._to.write(line.encode() + b"\n")
            self._expect(READY)
        except (OSError, TransportError):
            self.close()
            raise

    def _fail(self, what: str) -> TransportError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return TransportError(f"the KV receiver process stopped answering {what}")
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return TransportError(
            f"the KV receiver process died {what} ({why}): the prefill sent what this server "
            "did not post a receive for"
        )

    def _expect(self, kind: bytes) -> int:
        """The child's next frame, which must be `kind`: the slot of a DONE frame."""
        tag = _read_exact(self._from, 1)
        if tag == ERROR:
            (n,) = _LEN.unpack(_read_exact(self._from, _LEN.size))
            raise TransportError(_read_exact(self._from, n).decode(errors="replace"))
        if tag != kind:
            raise self._fail("while joining the pair" if kind == READY else "mid-transfer")
        return _SLOT.unpack(_read_exact(self._from, _SLOT.size))[0] if kind == DONE else 0

    def _ask(self, slot: int, nbytes: int) -> None:
        try:
            self._to.write(_COMMAND.pack(slot, nbytes))
        except OSError:
            raise self._fail("mid-transfer") from None

    def send(self, tensor: torch.Tensor) -> None:
        raise TransportError("the decode side's channel only receives")

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        flat = out.reshape(-1).view(torch.uint8)
        pieces = chunks(flat.numel())
        with self._lock:
            if self._closed:
                raise TransportError("the KV channel is closed")
            for i, (_, n) in enumerate(pieces[:SLOTS]):
                self._ask(i, n)
            for i, (off, n) in enumerate(pieces):
                slot = self._expect(DONE)
                if slot != i % SLOTS:
                    raise TransportError("the KV receiver process is out of step")
                flat[off : off + n].copy_(self._slots[slot * CHUNK_BYTES : slot * CHUNK_BYTES + n])
                if i + SLOTS < len(pieces):
                    self._ask(slot, pieces[i + SLOTS][1])
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # NOTE: a receiver thread blocked on the child's answer sees its end of file and stops
        self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            self._to.close()


# ---------------------------------------------------------------------- the child


def _error(out: IO[bytes], message: str) -> int:
    data = message.encode()
    out.write(ERROR + _LEN.pack(len(data)) + data)
    return 1


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this child when the server dies, even by SIGKILL (its receive
    may be blocked on the peer for the group's whole timeout and would never see stdin close)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the server died before the call
        os._exit(0)


def main() -> int:
    """The child: join the pair as rank 1, then receive what the server asks for."""
    import datetime

    import torch.distributed as dist

    from stallfree.disagg.pair_store import HttpStore

    # NOTE: frames go to the stdout the server reads; anything else printed goes to stderr
    inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    settings = json.loads(inp.readline())
    _die_with_parent(settings["parent"])
    shared = mmap.mmap(settings["fd"], SLOTS * CHUNK_BYTES)
    slots = torch.frombuffer(shared, dtype=torch.uint8)
    store = HttpStore(
        settings["base_url"], settings["pair_id"], settings["headers"], settings["join_timeout_s"]
    )
    try:
        group = dist.ProcessGroupGloo(
            store, 1, 2, datetime.timedelta(seconds=settings["group_timeout_s"])
        )
    except Exception as exc:
        return _error(out, f"joining the pair's group failed: {exc}")
    finally:
        store.close()
    out.write(READY)
    while True:
        command = _read_exact(inp, _COMMAND.size)
        if len(command) < _COMMAND.size:
            return 0  # the server closed the channel
        slot, nbytes = _COMMAND.unpack(command)
        if slot >= SLOTS or nbytes > CHUNK_BYTES:
            return _error(out, f"bad receive command (slot {slot}, {nbytes} bytes)")
        piece = slots[slot * CHUNK_BYTES : slot * CHUNK_BYTES + nbytes]
        try:
            group.recv([piece], 0, 0).wait()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            return _error(out, f"KV receive failed: {exc}")
        out.write(DONE + _SLOT.pack(slot))


if __name__ == "__main__":
    sys.exit(main())
