"""The CPU analogue of `torch.cuda.set_sync_debug_mode("error")`: strict mode's read guard.

On CUDA an implicit sync on the schedule path is an error under the sync debug mode. On the
CPU-emulated stream nothing is implicit: a read of a tensor the stream produced simply happens,
and it races the worker (the tensor may not be written yet). The guard makes such a read an
error:

- the stream registers every tensor it produces (uploads, computed tensors, device-resident
  state such as `req_to_token`) in a weak identity set;
- while the schedule path runs, a thread-local `TorchFunctionMode` is active on the scheduler's
  thread. Any torch call that takes a registered tensor raises `StrictReadError`, naming the
  operation (`.tolist()`, `.item()`, `bool()`, indexing, ...) and the call site. Only metadata
  (shape, dtype, device, length) may be read. The worker thread never sees the mode;
- `stream.synchronize()` and `event.synchronize()` raise the same way.

`host_read` (outside strict mode) and the debug parity checker read under `suspended()`.

The guard exists only when strict mode (or a test) asks for it: the production path neither
registers tensors nor enters the mode.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class ScheduleSyncError(RuntimeError):
    """A device read on the schedule path while strict mode is on."""


class StrictReadError(ScheduleSyncError):
    """A stream-owned tensor was read (or the stream waited on) from the schedule path."""


# Tensor attributes that are metadata, not values: reading them never waits for the device.
_META_ATTRS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "layout",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_nested",
        "requires_grad",
        "is_leaf",
        "itemsize",
        "nbytes",
        "names",
    }
)
_TB = torch._C.TensorBase
_META_FUNCS = frozenset(
    {
        _TB.size,
        _TB.dim,
        _TB.numel,
        _TB.nelement,
        _TB.stride,
        _TB.storage_offset,
        _TB.is_contiguous,
        _TB.is_floating_point,
        _TB.is_complex,
        _TB.element_size,
        _TB.data_ptr,
        _TB.get_device,
        torch.Tensor.__len__,
        torch.Tensor.__hash__,
    }
)
# how a value read is spelled at the call site, for the error message
_SPELLING = {
    "__bool__": "bool()",
    "__int__": "int()",
    "__float__": "float()",
    "__index__": "operator.index()",
    "__getitem__": "indexing []",
    "__setitem__": "indexed assignment []=",
    "__array__": ".numpy() / numpy.asarray()",
    "__repr__": "repr()",
    "__format__": "format()",
    "__iter__": "iteration",
    "__contains__": "`in`",
}

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = __file__


def _func_name(func: Any) -> tuple[str, bool]:
    """(name as written at the call site, is a metadata attribute)."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", None) == "__get__" and owner is not None:
        name = getattr(owner, "__name__", "?")
        return f".{name}", name in _META_ATTRS
    name = getattr(func, "__name__", None) or repr(func)
    if name in _SPELLING:
        return _SPELLING[name], False
    qual = getattr(func, "__qualname__", "") or ""
    if qual.startswith(("TensorBase.", "Tensor.")):
        return f".{name}()", False
    return f"torch.{name}()", False


def call_site(skip_files: tuple[str, ...] = ()) -> str:
    """`file:line in function` of the nearest caller outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (
            path.startswith(_TORCH_DIR)
            or path == _THIS_FILE
            or path in skip_files
            or path.startswith("<")
            or os.sep + "contextlib.py" in path
        ):
            return f"{_short(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def _short(path: str) -> str:
    marker = os.sep + "stallfree" + os.sep
    idx = path.rfind(marker)
    if idx < 0:
        marker = os.sep + "tests" + os.sep
        idx = path.rfind(marker)
    return path[idx + 1 :] if idx >= 0 else path


class _ReadGuardMode(TorchFunctionMode):
    def __init__(self, guard: StrictGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        guard = self.guard
        owned = guard._find_owned(args, kwargs) if guard._refs else None
        if owned is not None and func not in _META_FUNCS and not guard._state.suspended:
            name, meta = _func_name(func)
            if not meta:
                raise guard.violation(f"{name} on a stream-owned tensor {_describe(owned)}")
        return func(*args, **kwargs) if kwargs else func(*args)


def _describe(t: torch.Tensor) -> str:
    return f"(shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')})"


class _ThreadState(threading.local):
    active: int = 0
    suspended: int = 0


class StrictGuard:
    """A weak registry of stream-owned tensors and the schedule-path mode that guards them."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self._lock = threading.RLock()
        self._state = _ThreadState()
        self.violations = 0

    # ------------------------------------------------------------------ registry

    def register(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark `tensor` as the stream's; returns it. Any thread may register."""
        key = id(tensor)
        refs, lock = self._refs, self._lock

        def drop(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            with lock:
                if refs.get(key) is ref:
                    del refs[key]

        with lock:
            refs[key] = weakref.ref(tensor, drop)
        return tensor

    def owns(self, tensor: object) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def __len__(self) -> int:
        return len(self._refs)

    def _find_owned(
        self, args: tuple[Any, ...], kwargs: dict[str, Any] | None
    ) -> torch.Tensor | None:
        refs = self._refs
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, torch.Tensor):
                ref = refs.get(id(a))
                if ref is not None and ref() is a:
                    return a
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                for t in a:
                    ref = refs.get(id(t))
                    if ref is not None and ref() is t:
                        return t
        return None

    # ------------------------------------------------------------------ the schedule path

    @property
    def active(self) -> bool:
        """The schedule path is running on this thread and the guard is not suspended."""
        state = self._state
        return state.active > 0 and state.suspended == 0

    @contextlib.contextmanager
    def schedule_path(self) -> Iterator[None]:
        """Guard this thread's torch calls (re-entrant); other threads are unaffected."""
        state = self._state
        if state.active:
            state.active += 1
            try:
                yield
            finally:
                state.active -= 1
            return
        state.active = 1
        try:
            with _ReadGuardMode(self):
                yield
        finally:
            state.active = 0

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """A sanctioned read: `host_read` outside strict mode, the debug parity checker."""
        state = self._state
        state.suspended += 1
        try:
            yield
        finally:
            state.suspended -= 1

    def check_wait(self, what: str, skip_files: tuple[str, ...] = ()) -> None:
        """Called by a stream or event before it blocks on the device (`skip_files`: its own)."""
        if self.active:
            raise self.violation(what, skip_files)

    def violation(self, what: str, skip_files: tuple[str, ...] = ()) -> StrictReadError:
        self.violations += 1
        return StrictReadError(
            f"strict mode: {what} at {call_site(skip_files)} on the schedule path; the schedule "
            "path may "
            "read only host state and CPU mirrors (host_read is the one sanctioned device read, "
            "and only outside strict mode)"
        )
