"""Dense bodies waiting for the screening process: taken in turn per client, each with a deadline.

The screening process checks one body at a time. A single queue would answer one client's 40
bodies before another client's one, so each client (`client_key`: its API key where the server
has keys, else its address) has its own queue, and the dispatcher takes one body from each
client with bodies waiting in turn (round robin). A body in the process past its deadline means
the process is stuck (stopped, or looping): it is killed, the next body starts a new one, and
the body's request is answered `ScreeningTimeout`. The deadline starts once the process is up
(a new one first answers a no-op, within `START_S`: spawning it imports the server's modules); so is every body that meets a process that
died under it (`BrokenProcessPool`). A request whose client went away is skipped.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

# how long a new screening process may take to start (import its modules) and answer
START_S = 120.0


class ScreeningTimeout(Exception):
    """The screening process did not answer within the deadline; it has been replaced."""


@dataclass(slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    deadline_s: float
    future: Future[Any]


class FairScreening:
    """Runs `fn(*args)` in the pool `pool()` hands out, one job at a time, round robin over
    clients. `restart(pool, kill)` drops a pool that is stuck (`kill`: end its processes) or
    broken, so that `pool()` makes a new one."""

    def __init__(
        self,
        pool: Callable[[], ProcessPoolExecutor],
        restart: Callable[[ProcessPoolExecutor, bool], None],
    ) -> None:
        self._pool = pool
        self._restart = restart
        self._ready = threading.Condition()
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._started: ProcessPoolExecutor | None = None  # the pool whose process is up
        self.timeouts = 0  # stuck processes killed, for the logs and the tests

    def submit(
        self, client: str, deadline_s: float, fn: Callable[..., Any], *args: Any
    ) -> Future[Any]:
        """`fn(*args)` queued behind `client`'s other jobs; cancel the future to drop it."""
        job = _Job(fn, args, deadline_s, Future())
        with self._ready:
            self._queues.setdefault(client, deque()).append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="stallfree-screen-queue", daemon=True
                )
                self._thread.start()
            self._ready.notify()
        return job.future

    def waiting(self) -> int:
        """Jobs queued and not yet taken."""
        with self._ready:
            return sum(len(q) for q in self._queues.values())

    def _take(self) -> _Job:
        with self._ready:
            while not self._queues:
                self._ready.wait()
            client, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            if queue:
                self._queues.move_to_end(client)  # its next job waits for the others' turns
            else:
                del self._queues[client]
            return job

    def _serve(self) -> None:
        while True:
            job = self._take()
            if job.future.set_running_or_notify_cancel():
                self._run(job)

    def _run(self, job: _Job) -> None:
        try:
            pool = self._pool()
            try:
                self._start(pool)
            except RuntimeError:  # shut down (`close_screening`) since it was handed out
                pool = self._pool()
                self._start(pool)
            result = pool.submit(job.fn, *job.args).result(timeout=job.deadline_s)
        except concurrent.futures.TimeoutError:
            self.timeouts += 1
            self._restart(pool, True)
            job.future.set_exception(ScreeningTimeout())
        except BrokenProcessPool as exc:  # the process died under this body
            self._restart(pool, False)
            job.future.set_exception(exc)
        except BaseException as exc:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _start(self, pool: ProcessPoolExecutor) -> None:
        """Wait for `pool`'s process to be up, if it is new."""
        if pool is not self._started:
            pool.submit(_ready).result(timeout=START_S)
            self._started = pool


def _ready() -> bool:
    return True
