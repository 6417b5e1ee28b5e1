"""Device streams: one interface, a CUDA implementation and a CPU-emulated one.

Everything that touches a device tensor after launch goes through `submit`/`compute`, so it
runs in FIFO order on the stream. The host only ever enqueues and waits on events.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from stallfree.overlap.omp_pool import release_caller_pool
from stallfree.overlap.strict import StrictGuard

_STREAM_FILE = __file__


class StreamError(RuntimeError):
    """Work enqueued on the stream raised; carried to the next event that is waited on."""


class Event(ABC):
    @abstractmethod
    def query(self) -> bool: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    async def wait(self) -> None:
        """Wait without blocking the asyncio loop; raises StreamError if enqueued work failed."""


class DeviceStream(ABC):
    device: torch.device
    # strict mode's read guard (CPU stream only); None on the production path
    guard: StrictGuard | None = None

    def attach_guard(self, guard: StrictGuard) -> None:
        """Register every tensor this stream produces from now on with `guard`."""
        self.guard = guard

    def adopt(self, *tensors: torch.Tensor) -> None:
        """Declare device-resident state (pools, caches) the stream's, for the guard."""
        if self.guard is not None:
            for t in tensors:
                self.guard.register(t)

    def _produced(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor this stream produced (an upload, a compute result): the guard knows it."""
        if self.guard is not None:
            self.guard.register(tensor)
        return tensor

    @abstractmethod
    def upload(self, cpu: torch.Tensor) -> torch.Tensor:
        """Host-to-device copy of an immutable host tensor, enqueued non-blocking."""

    @abstractmethod
    def compute(
        self,
        fn: Callable[..., torch.Tensor],
        *args: Any,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Enqueue `fn(*args)`; returns the (future) device tensor of the given shape."""

    @abstractmethod
    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Enqueue side-effecting work (writes to device-resident state, a forward step)."""

    @abstractmethod
    def record_event(self) -> Event: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor a device-to-host copy may target (pinned on CUDA)."""

    @property
    @abstractmethod
    def busy_seconds(self) -> float:
        """Seconds the device spent executing enqueued work (settled up to the last waited event)."""

    @contextlib.contextmanager
    def schedule_guard(self, strict: bool) -> Iterator[None]:
        """Context for batch preparation; CUDA turns implicit syncs into errors in strict mode."""
        yield

    def close(self) -> None:
        return None


# ---------------------------------------------------------------- CPU-emulated stream


class CpuEvent(Event):
    def __init__(self, guard: StrictGuard | None = None) -> None:
        self._guard = guard
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.error: BaseException | None = None

    def _set(self, error: BaseException | None) -> None:
        with self._lock:
            self.error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if self._guard is not None:
            self._guard.check_wait("event.synchronize()", (_STREAM_FILE,))
        self._done.wait()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise StreamError(str(self.error)) from self.error

    async def wait(self) -> None:
        if not self._done.is_set():
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()

            def resolve() -> None:
                if not fut.done():
                    fut.set_result(None)

            def wake() -> None:
                loop.call_soon_threadsafe(resolve)

            with self._lock:
                registered = not self._done.is_set()
                if registered:
                    self._callbacks.append(wake)
            if registered:
                await fut
        self._raise()


class CpuStream(DeviceStream):
    """One worker thread runs enqueued work in FIFO order.

    torch releases the GIL inside its kernels, so a matmul-dominated forward on the worker
    overlaps for real with the scheduler's Python on the main thread.

    Small ops from `compute` are collected on the host and handed over with the next `submit` or
    event, so preparing a batch wakes the worker once or twice, not once per small op.
    """

    def __init__(self, num_threads: int = 0) -> None:
        self.device = torch.device("cpu")
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._busy = 0.0
        self._error: BaseException | None = None
        self._num_threads = num_threads
        self._batch: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        # the thread handing work over gives up its OpenMP pool (omp_pool.py), once
        self._feeder: int | None = None
        self._worker = threading.Thread(target=self._run, name="stallfree-cpu-stream", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    fn(*args)
            except BaseException as exc:  # carried to the next event, like a CUDA error
                if self._error is None:
                    self._error = exc
            self._busy += time.perf_counter() - start

    def upload(self, cpu: torch.Tensor) -> torch.Tensor:
        # NOTE: host tensors handed here are never mutated afterwards, so a clone is the copy.
        return self._produced(cpu.clone())

    def compute(
        self,
        fn: Callable[..., torch.Tensor],
        *args: Any,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self._batch.append((lambda: out.copy_(fn(*args)), ()))
        return self._produced(out)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        # NOTE: submitted work starts now, as a kernel launch would; small ops made by
        # `compute` ride along with it instead of waking the worker one by one
        self._batch.append((fn, args))
        self._hand_over()

    def record_event(self) -> Event:
        event = CpuEvent(self.guard)
        self._batch.append((self._fire, (event,)))
        self._hand_over()
        return event

    def _hand_over(self) -> None:
        if self._feeder is None:
            self._feeder = threading.get_ident()
            if self._feeder != self._worker.ident:
                release_caller_pool()
        batch, self._batch = self._batch, []
        self._queue.put((self._run_batch, (batch,)))

    def _run_batch(self, batch: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
        for fn, args in batch:
            try:
                fn(*args)
            except BaseException as exc:  # carried to the next event, like a CUDA error
                if self._error is None:
                    self._error = exc

    def _fire(self, event: CpuEvent) -> None:
        error, self._error = self._error, None
        event._set(error)

    def synchronize(self) -> None:
        if self.guard is not None:
            self.guard.check_wait("stream.synchronize()", (_STREAM_FILE,))
        self.record_event().synchronize()

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    @property
    def busy_seconds(self) -> float:
        return self._busy

    def close(self) -> None:
        if self._batch:
            self.record_event()
        self._queue.put(None)
        self._worker.join(timeout=10)


# ---------------------------------------------------------------- CUDA stream


class CudaEvent(Event):
    def __init__(self, stream: CudaStream, start: torch.cuda.Event | None) -> None:
        self._stream = stream
        self._start = start
        self.event = torch.cuda.Event(enable_timing=start is not None)  # type: ignore[no-untyped-call]
        self.event.record(stream.stream)

    def query(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        self.event.synchronize()
        self._settle()

    async def wait(self) -> None:
        if not self.event.query():  # type: ignore[no-untyped-call]
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._stream.waiter, self.event.synchronize)
        self._settle()

    def _settle(self) -> None:
        if self._start is not None:
            self._stream._busy += self._start.elapsed_time(self.event) / 1000.0
            self._start = None


class CudaStream(DeviceStream):
    """A `torch.cuda.Stream`; uploads go through pinned memory with `non_blocking` copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stallfree-cuda-wait")
        self._busy = 0.0
        self._step_start: torch.cuda.Event | None = None

    def upload(self, cpu: torch.Tensor) -> torch.Tensor:
        # NOTE: torch's caching host allocator records the copy on the stream, so the pinned
        # block is not reused before the async copy has read it.
        pinned = cpu.pin_memory()
        with torch.cuda.stream(self.stream):
            return pinned.to(self.device, non_blocking=True)

    def compute(
        self,
        fn: Callable[..., torch.Tensor],
        *args: Any,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            return fn(*args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._step_start is None:
            self._step_start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._step_start.record(self.stream)
        with torch.cuda.stream(self.stream), torch.inference_mode():
            fn(*args)

    def record_event(self) -> Event:
        start, self._step_start = self._step_start, None
        event = CudaEvent(self, start)
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    @property
    def busy_seconds(self) -> float:
        return self._busy

    @contextlib.contextmanager
    def schedule_guard(self, strict: bool) -> Iterator[None]:
        if not strict:
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def close(self) -> None:
        self.waiter.shutdown(wait=False)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("runtime.device is 'cuda' but torch reports no CUDA device")
    return torch.device(name)


def make_stream(device: torch.device, num_threads: int = 0) -> DeviceStream:
    if device.type == "cuda":
        return CudaStream(device)
    return CpuStream(num_threads)
