"""The adapters a server knows by name, their weights in host memory, and the device slots
they run from.

A request under an adapter holds a lease on a slot from its submission until its stream ends;
a slot whose adapter no request holds is inactive, and a new adapter takes the least recently
used inactive slot (an empty one first). With every slot held, the request waits until one is
released. A slot is written by work enqueued on the stream, after every step launched before:
a step in flight reads the weights its rows were scheduled with.

Host memory keeps the weights of at most `max_cpu_loras` adapters (least recently used out); an
adapter whose weights were dropped is read from its checkpoint again when a request needs it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stallfree.config.lora import LoraConfig
from stallfree.overlap.stream import DeviceStream
from stallfree.runtime.lora.checkpoint import (
    AdapterError,
    AdapterNotFoundError,
    LoraAdapter,
    read_adapter,
)
from stallfree.runtime.model.lora import Weights


class SlotTable(Protocol):
    """Where adapter slots live: the model's wrappers in this process (`model.lora.LoraSlots`)
    or the worker processes' (`lora.workers.WorkerSlots`)."""

    # (in, out) of every adaptable projection of the whole model, by (layer, target)
    shapes: dict[tuple[int, str], tuple[int, int]]

    def write(self, slot: int, weights: Weights) -> None: ...


@dataclass(slots=True, frozen=True)
class LoraInfo:
    """A registered adapter: its name, checkpoint, load id and the base model it serves on."""

    name: str
    path: str
    uid: int
    base_model_name: str
    rank: int


@dataclass(slots=True, frozen=True)
class Lease:
    slot: int
    uid: int


@dataclass(slots=True, eq=False)
class LoraRegistry:
    table: SlotTable
    stream: DeviceStream
    config: LoraConfig
    dtype: torch.dtype
    base_names: tuple[str, ...]  # the names the base model answers to (served name first)
    adapters: dict[str, LoraInfo] = field(default_factory=dict)
    host: OrderedDict[int, LoraAdapter] = field(default_factory=OrderedDict)
    slot_uid: list[int] = field(init=False)  # 0: empty
    refs: list[int] = field(init=False)
    last_used: list[int] = field(init=False)
    _ticks: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _uids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.config.max_loras
        self.slot_uid, self.refs, self.last_used = [0] * n, [0] * n, [0] * n

    # ------------------------------------------------------------------ names

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoraInfo:
        """Register an adapter under `name`; `AdapterError` (400) says why one is refused. The
        checkpoint is read off the event loop."""
        self._check_new(name, path, base_model_name)
        adapter = await asyncio.to_thread(self._read, name, path)
        self._check_new(name, path, base_model_name)  # loaded by another call meanwhile?
        return self._register(name, path, adapter)

    def load_now(self, name: str, path: str, base_model_name: str | None = None) -> LoraInfo:
        """`load`, reading on this thread (the adapters of `lora.lora_modules`, at build)."""
        self._check_new(name, path, base_model_name)
        return self._register(name, path, self._read(name, path))

    def _check_new(self, name: str, path: str, base_model_name: str | None) -> None:
        if not isinstance(name, str) or not name or len(name) > 256:
            raise AdapterError("lora_name must be a non-empty string of at most 256 characters")
        if not isinstance(path, str) or not path:
            raise AdapterError("lora_path must be a non-empty string")
        if name in self.adapters:
            raise AdapterError(f"the adapter {name!r} is already loaded", code="already_loaded")
        if name in self.base_names:
            raise AdapterError(f"{name!r} is the base model's name", code="name_taken")
        if base_model_name is not None and base_model_name not in self.base_names:
            raise AdapterError(
                f"the adapter {name!r} is for base model {base_model_name!r}; this server "
                f"serves {self.base_names[0]!r}",
                code="base_model_mismatch",
            )

    def _register(self, name: str, path: str, adapter: LoraAdapter) -> LoraInfo:
        info = LoraInfo(name, path, next(self._uids), self.base_names[0], adapter.rank)
        self.adapters[name] = info
        self._keep(info.uid, adapter)
        return info

    def unload(self, name: str) -> LoraInfo:
        """Forget `name`: new requests cannot pick it; requests already holding it finish on
        it, and its slot empties once the last one is done."""
        info = self.adapters.pop(name, None)
        if info is None:
            raise AdapterNotFoundError(name)
        self.host.pop(info.uid, None)
        for slot, uid in enumerate(self.slot_uid):
            if uid == info.uid and self.refs[slot] == 0:
                self.slot_uid[slot] = 0
        self._wake()
        return info

    def _read(self, name: str, path: str) -> LoraAdapter:
        cfg = self.config
        return read_adapter(name, path, self.table.shapes, cfg.max_lora_rank, self.dtype)

    def _keep(self, uid: int, adapter: LoraAdapter) -> None:
        self.host[uid] = adapter
        self.host.move_to_end(uid)
        while len(self.host) > self.config.cpu_loras:
            self.host.popitem(last=False)

    # ------------------------------------------------------------------ slots

    async def acquire(self, name: str) -> Lease:
        """A slot holding adapter `name`, held until `release`; waits while every slot is held
        by other adapters' requests."""
        info = self.adapters.get(name)
        if info is None:
            raise AdapterNotFoundError(name)
        while True:
            if self.adapters.get(name) is not info:
                raise AdapterNotFoundError(name)  # unloaded while this request waited
            slot = self._resident(info.uid)
            if slot is None and (slot := self._inactive()) is not None:
                adapter = self.host.get(info.uid)
                if adapter is None:  # dropped from host memory: read it again, then look anew
                    self._keep(info.uid, await asyncio.to_thread(self._read, name, info.path))
                    continue
                self._fill(slot, info.uid, adapter)
            if slot is not None:
                self.refs[slot] += 1
                self.last_used[slot] = next(self._ticks)
                return Lease(slot, info.uid)
            await self._wait()

    def release(self, lease: Lease) -> None:
        slot = lease.slot
        assert self.refs[slot] > 0 and self.slot_uid[slot] == lease.uid
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            if not any(i.uid == lease.uid for i in self.adapters.values()):
                self.slot_uid[slot] = 0  # unloaded meanwhile: the slot is free
            self._wake()

    def _resident(self, uid: int) -> int | None:
        for slot, held in enumerate(self.slot_uid):
            if held == uid:
                return slot
        return None

    def _inactive(self) -> int | None:
        """An empty slot, else the least recently used one no request holds."""
        free = [s for s, uid in enumerate(self.slot_uid) if uid == 0]
        if free:
            return free[0]
        idle = [s for s, n in enumerate(self.refs) if n == 0]
        return min(idle, key=lambda s: self.last_used[s]) if idle else None

    def _fill(self, slot: int, uid: int, adapter: LoraAdapter) -> None:
        self.slot_uid[slot] = uid
        # NOTE: on the stream, after every launched step: those still read the old weights
        self.stream.submit(self.table.write, slot, adapter.weights)

    async def _wait(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ------------------------------------------------------------------ views

    def free_slots(self) -> int:
        """Slots no request holds (all of them once every lease is released)."""
        return sum(1 for n in self.refs if n == 0)

    def held(self) -> int:
        return sum(self.refs)
