"""`ProcessStream`: the device stream when the device lives in worker processes.

The scheduler's side of the `DeviceStream` contract holds unchanged:
- `upload`, `compute` and `submit` run at once, on the host, against the host's replica of the
  batch tensors (CPU tensors, the same values the workers get). They are a few small integer ops
  per step; the read guard treats what they produce as the stream's, as on the CPU stream.
- `send` hands one step to the workers. Steps run in the order they are sent (FIFO).
- An event fires when the workers have answered every step sent before it was recorded, and
  carries the first error since the previous event (`StreamError`), as a CUDA event would.
- `synchronize` waits for every step sent: in the legacy mode a `host_read` is a real stall,
  the wait for the device to finish.

A worker that dies, or that fails a step, makes the stream fatal (`WorkerLostError`): every
pending and later event fails, and `on_fatal` is called once, from the receiver thread, so the
engine fails closed instead of waiting forever.

Messages are pickled bytes (`encode_tensor` packs a CPU tensor without numpy). Only the rank-0
worker answers, with its results; the receiver thread also watches every local worker process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from stallfree.overlap.stream import CpuEvent, DeviceStream, Event, StreamError

logger = logging.getLogger(__name__)

# how often the receiver thread looks at worker processes when no answer arrives
WATCH_INTERVAL_S = 0.2
JOIN_TIMEOUT_S = 10.0


class WorkerLostError(StreamError):
    """A worker process died or failed a step: the device state is gone or out of step."""


EncodedTensor = tuple[str, tuple[int, ...], bytes]


def encode_tensor(t: torch.Tensor) -> EncodedTensor:
    """A CPU tensor as (dtype name, shape, raw bytes): cheap to pickle, no numpy needed."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        raise ValueError("encode_tensor takes host tensors only")
    raw = ctypes.string_at(t.data_ptr(), t.nbytes) if t.nbytes else b""
    return (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)


def decode_tensor(enc: EncodedTensor) -> torch.Tensor:
    dtype_name, shape, raw = enc
    dtype = getattr(torch, dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


ResultHandler = Callable[[Any], None]


class ProcessStream(DeviceStream):
    def __init__(
        self,
        conn: Connection,
        processes: list[BaseProcess],
        on_fatal: Callable[[BaseException], None] | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        self.device = torch.device("cpu")
        self._conn = conn
        self._processes = processes
        self.on_fatal = on_fatal
        # the watchdog: steps pending and no answer for this long means a hung worker
        self.step_timeout_s = step_timeout_s
        self._progress_at = time.monotonic()  # the last answer, or work arriving at idle workers
        self._lock = threading.Lock()
        self._sent = 0
        self._answered = 0
        self._handlers: dict[int, ResultHandler] = {}
        self._events: list[tuple[int, CpuEvent]] = []  # (last step it waits for, event)
        self._host_error: BaseException | None = None  # from an inline op; next event carries it
        self._step_error: BaseException | None = None
        self.fatal: WorkerLostError | None = None
        self._busy = 0.0
        self.bytes_sent = 0
        self.steps_sent = 0
        self._closing = False
        self._receiver = threading.Thread(
            target=self._receive, name="stallfree-worker-receiver", daemon=True
        )
        self._receiver.start()

    # ------------------------------------------------------------------ host-side ops

    def _suspended(self) -> contextlib.AbstractContextManager[None]:
        return self.guard.suspended() if self.guard is not None else contextlib.nullcontext()

    def upload(self, cpu: torch.Tensor) -> torch.Tensor:
        return self._produced(cpu.clone())

    def compute(
        self,
        fn: Callable[..., torch.Tensor],
        *args: Any,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        try:
            with self._suspended():
                out.copy_(fn(*args))
        except Exception as exc:  # carried to the next event, as on a device
            self._note_host_error(exc)
        return self._produced(out)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            with self._suspended():
                fn(*args)
        except Exception as exc:
            self._note_host_error(exc)

    def _note_host_error(self, exc: BaseException) -> None:
        with self._lock:
            if self._host_error is None:
                self._host_error = exc

    def packing(self) -> contextlib.AbstractContextManager[None]:
        """Context for packing a step's tensors into a message: the host replica holds the
        values the workers get, so this is a copy to the channel, not a device read."""
        return self._suspended()

    # ------------------------------------------------------------------ steps and events

    def send_payload(self, payload: bytes, handler: ResultHandler) -> int:
        """Hand one step (a pickled message) to the workers, in order; `handler(result)` runs
        on the receiver thread when rank 0 answers, before the step's event fires."""
        with self._lock:
            if self.fatal is not None:
                raise self.fatal
            if self._answered == self._sent:
                self._progress_at = time.monotonic()  # idle workers start on this step now
            self._sent += 1
            seq = self._sent
            self._handlers[seq] = handler
        frame = pickle.dumps(("step", seq, payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._conn.send_bytes(frame)
        except (OSError, ValueError) as exc:
            self._lose(WorkerLostError(f"sending step {seq} to the workers failed: {exc!r}"))
            raise self.fatal or exc from None
        self.bytes_sent += len(frame)
        self.steps_sent += 1
        return seq

    def record_event(self) -> Event:
        event = CpuEvent(self.guard)
        with self._lock:
            error, self._host_error = self._host_error, None
            target = self._sent
            if self.fatal is not None:
                ready, error = True, error or self.fatal
            else:
                ready = self._answered >= target
                if ready:
                    error = error or self._step_error
                    self._step_error = None
            if not ready:
                if error is not None and self._step_error is None:
                    self._step_error = error
                self._events.append((target, event))
        if ready:
            event._set(error)
        return event

    def synchronize(self) -> None:
        if self.fatal is not None:
            # NOTE: nothing sent will ever finish, and every pending event has failed already;
            # the host replica is all there is, so the engine's fail-closed cleanup goes on
            return
        self.record_event().synchronize()

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    @property
    def busy_seconds(self) -> float:
        return self._busy

    def add_busy(self, seconds: float) -> None:
        self._busy += seconds

    # ------------------------------------------------------------------ the receiver thread

    def _receive(self) -> None:
        sentinels = {p.sentinel: p for p in self._processes}
        while not self._closing:
            try:
                ready = wait([self._conn, *sentinels], timeout=WATCH_INTERVAL_S)
            except (OSError, ValueError):
                ready = []
                if self._closing:
                    return
            if not ready and self._hung():
                return
            for item in ready:
                if item is self._conn:
                    if not self._take_answer():
                        return
                else:
                    proc = sentinels[item]  # type: ignore[index]
                    if self._closing:
                        return
                    proc.join(timeout=1.0)  # reaped, so its exit code is known
                    self._lose(
                        WorkerLostError(
                            f"worker process {proc.name} (pid {proc.pid}) exited with code "
                            f"{proc.exitcode}"
                        )
                    )
                    return

    def _hung(self) -> bool:
        """The watchdog: steps are pending and none was answered for `step_timeout_s` (a
        stopped or wedged worker; one that dies is seen by its sentinel instead)."""
        timeout = self.step_timeout_s
        with self._lock:
            pending = self._sent - self._answered
            quiet = time.monotonic() - self._progress_at
        if timeout is None or pending <= 0 or quiet < timeout or self.fatal is not None:
            return False
        self._lose(
            WorkerLostError(
                f"the workers answered no step for {quiet:.1f}s with {pending} pending "
                f"(step {self._answered + 1} first; runtime.step_timeout_s={timeout:g}): "
                "a worker is hung"
            )
        )
        return True

    def _take_answer(self) -> bool:
        try:
            kind, seq, body = self._conn.recv()
        except (EOFError, OSError) as exc:
            if not self._closing:
                self._lose(WorkerLostError(f"the rank-0 worker's channel closed: {exc!r}"))
            return False
        if kind == "ok":
            handler = self._handlers.pop(seq, None)
            try:
                if handler is not None:
                    handler(body)
            except Exception as exc:  # a result that cannot be read is that step's error
                self._answer(seq, exc)
            else:
                self._answer(seq, None)
            return True
        # "error": the step raised in a worker; its requests fail, then the engine (fail closed)
        self._answer(seq, StreamError(str(body)))
        self._lose(WorkerLostError(f"a worker failed step {seq}: {body}"))
        return False

    def _answer(self, seq: int, error: BaseException | None) -> None:
        fire: list[tuple[CpuEvent, BaseException | None]] = []
        with self._lock:
            self._answered = max(self._answered, seq)
            self._progress_at = time.monotonic()
            if error is not None and self._step_error is None:
                self._step_error = error
            keep = []
            for target, event in self._events:
                if target <= self._answered:
                    fire.append((event, self._step_error))
                    self._step_error = None
                else:
                    keep.append((target, event))
            self._events = keep
        for event, err in fire:
            event._set(err)

    def _lose(self, error: WorkerLostError) -> None:
        with self._lock:
            if self.fatal is not None:
                return
            self.fatal = error
            events, self._events = self._events, []
            self._handlers.clear()
        logger.error("%s; failing the engine closed", error)
        for _, event in events:
            event._set(error)
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:
                logger.exception("on_fatal callback failed")

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop every worker and join it; a worker that does not stop is killed."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(OSError, ValueError):
            self._conn.send_bytes(pickle.dumps(("stop", 0, None)))
        # a lost (dead or hung) group will not drain: terminate what is left at once
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if self.fatal is None else 0.5)
        for proc in self._processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._processes:
            if proc.is_alive():
                logger.warning("worker %s did not stop; terminating it", proc.name)
                proc.terminate()
                proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        with contextlib.suppress(OSError):
            self._conn.close()
        self._receiver.join(timeout=2.0)

    @property
    def processes(self) -> list[BaseProcess]:
        return list(self._processes)
