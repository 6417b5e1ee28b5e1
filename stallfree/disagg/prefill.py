"""The prefill server's side: compute a prompt's KV and first token, push the KV to the decode
server's preallocated pages, keep it until the decode side acknowledges (or the deadline
passes), then free it (the prefix cache may keep it).

A room opens when either its request or the decode side's registration (its destination pages)
arrives; the transfer starts once both are there and the request's KV is held. Each pair of
servers has one sender thread, which sends its rooms in order on the pair's channel.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.config import DisaggregationConfig, FaultConfig
from stallfree.disagg.fingerprint import Fingerprint, HandshakeError
from stallfree.disagg.pair_store import MemoryStore
from stallfree.disagg.rooms import RequestStalledError, Room, RoomError, RoomState
from stallfree.disagg.side import RoomSide
from stallfree.disagg.transport import (
    KVChannel,
    LoopbackChannel,
    RoomHeader,
    RoomTail,
    TransportError,
    contiguous_runs,
    send_header,
    send_layer,
    send_tail,
)
from stallfree.overlap.faults import TransferFault, TransferFaults
from stallfree.runtime.engine import Engine
from stallfree.runtime.handoff import KVExport
from stallfree.runtime.request.outputs import GenerationChunk
from stallfree.runtime.request.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# pairs at once: each holds a sender thread (and, until the decode side joins, a rendezvous)
MAX_PAIRS = 64


class RoomLimitError(ValueError):
    """A registration beyond `disaggregation.max_rooms` or `max_rooms_per_pair`."""


class RegistrationError(ValueError):
    """A registration no prompt on this server could match (more pages than its pool)."""


@dataclass(slots=True)
class Registration:
    """The decode side's destination for a room: its pages, on which pair."""

    pair_id: str
    pages: Sequence[int]  # an array("q") from the endpoint: 8 bytes a page
    num_tokens: int


@dataclass(eq=False)
class _Pair:
    pair_id: str
    shards: list[tuple[int, int]]  # KV-head range of each decode rank
    store: MemoryStore  # the group's rendezvous, reached by the decode side over the endpoint
    channel: KVChannel | None = None
    rooms: set[int] = field(default_factory=set)  # registered by this pair and still open
    ready: threading.Event = field(default_factory=threading.Event)
    jobs: queue.SimpleQueue[Callable[[], None] | None] = field(default_factory=queue.SimpleQueue)
    alive: bool = True
    error: str | None = None


class PrefillSide(RoomSide):
    def __init__(
        self,
        engine: Engine,
        config: DisaggregationConfig,
        faults: FaultConfig | None = None,
        backend: str = "gloo",
    ) -> None:
        super().__init__(engine, "prefill")
        self.config = config
        self.backend = backend  # gloo | nccl | loopback
        self.pairs: dict[str, _Pair] = {}
        self.faults = TransferFaults(faults) if faults is not None and faults.enabled else None

    # ------------------------------------------------------------------ life

    async def close(self) -> None:
        await self._stop("prefill server shutting down")
        for pair in list(self.pairs.values()):
            self._drop_pair(pair, "prefill server shutting down")

    def info(self) -> dict[str, Any]:
        return {
            "role": "prefill",
            "fingerprint": self.fingerprint.model_dump(),
            "backend": self.backend,
        }

    def pair_store(self, pair_id: str) -> MemoryStore | None:
        """A live pair's rendezvous (None for a pair that is not, or no longer, known)."""
        pair = self.pairs.get(pair_id)
        return pair.store if pair is not None and pair.alive else None

    # ------------------------------------------------------------------ pairing

    def pair(self, decode: Fingerprint, shards: Sequence[Sequence[int]]) -> dict[str, Any]:
        """A decode server asks to pair: check it can take this server's KV, then open the
        pair's channel (rank 0 of a two-rank group; the decode side joins as rank 1)."""
        self.fingerprint.check_decode(decode)
        if len(self.pairs) >= MAX_PAIRS:
            raise HandshakeError(
                f"this prefill server is paired with {len(self.pairs)} decode servers already "
                f"(at most {MAX_PAIRS})"
            )
        heads = [(int(a), int(b)) for a, b in shards]
        if not heads or any(not 0 <= a < b <= decode.num_kv_heads for a, b in heads):
            raise HandshakeError(f"decode KV-head shards {heads} do not fit the model")
        pair = _Pair(uuid.uuid4().hex, heads, MemoryStore(self.config.pair_timeout_s))
        self.pairs[pair.pair_id] = pair
        threading.Thread(
            target=self._sender,
            args=(pair,),
            name=f"stallfree-kv-send-{pair.pair_id[:8]}",
            daemon=True,
        ).start()
        return {"pair_id": pair.pair_id, "backend": self.backend}

    def loopback_channel(self, pair_id: str) -> LoopbackChannel:
        """The loopback backend: the decode side's end of the pair's channel."""
        pair = self.pairs[pair_id]
        channel = LoopbackChannel()
        pair.channel = channel
        pair.ready.set()
        return channel

    def _open_channel(self, pair: _Pair) -> None:
        if pair.channel is not None or self.backend == "loopback":
            pair.ready.wait(timeout=self.config.bootstrap_timeout_s)
            return
        from stallfree.disagg.dist import DistChannel

        device = self.engine.core.ctx.kv_cache.device
        pair.channel = DistChannel(pair.store, 0, self.backend, device)
        pair.ready.set()

    def _sender(self, pair: _Pair) -> None:
        """The pair's thread: open its channel, then run its send jobs in order."""
        try:
            self._open_channel(pair)
            if pair.channel is None:
                raise TransportError("the decode side never joined the pair")
        except Exception as exc:
            self._post(self._drop_pair, pair, f"pairing failed: {exc}")
            return
        while True:
            job = pair.jobs.get()
            if job is None:
                return
            job()

    def _drop_pair(self, pair: _Pair, why: str) -> None:
        if not pair.alive:
            return
        pair.alive, pair.error = False, why
        self.pairs.pop(pair.pair_id, None)
        pair.jobs.put(None)
        for room in self.rooms:
            reg = room.data.get("registration")
            lost = reg is not None and reg.pair_id == pair.pair_id
            if lost and room.fail(f"pair with the decode server lost: {why}", "transfer"):
                self.stats.failed("transfer")
        channel, pair.channel = pair.channel, None
        if channel is not None:
            channel.close()

    # ------------------------------------------------------------------ rooms

    def _room(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is None:
            room = self.rooms.open(
                room_id, RoomState.BOOTSTRAPPING, self.config.bootstrap_timeout_s
            )
            room.on_final.append(self._room_final)
        return room

    def register(self, room_id: int, reg: Registration) -> None:
        """The decode side's destination pages for a room."""
        pair = self.pairs.get(reg.pair_id)
        if pair is None or not pair.alive:
            raise KeyError(f"unknown pair {reg.pair_id}")
        allocator = self.engine.core.ctx.allocator
        if len(reg.pages) > allocator.num_pages:
            raise RegistrationError(
                f"{len(reg.pages)} destination pages: no prompt here has more than this "
                f"server's {allocator.num_pages} pages"
            )
        if reg.num_tokens > len(reg.pages) * allocator.page_size:
            raise RegistrationError(
                f"{reg.num_tokens} tokens do not fit {len(reg.pages)} pages of "
                f"{allocator.page_size} tokens"
            )
        cfg = self.config
        if len(pair.rooms) >= cfg.max_rooms_per_pair:
            raise RoomLimitError(
                f"this decode server has {len(pair.rooms)} rooms registered here already (at "
                f"most disaggregation.max_rooms_per_pair={cfg.max_rooms_per_pair})"
            )
        if self.rooms.get(room_id) is None and len(self.rooms) >= cfg.max_rooms:
            raise RoomLimitError(
                f"this prefill server has {len(self.rooms)} rooms open (at most "
                f"disaggregation.max_rooms={cfg.max_rooms})"
            )
        room = self._room(room_id)
        if "registration" in room.data or room.final:
            raise ValueError(f"room {room_id} is registered already")
        room.data["registration"] = reg
        pair.rooms.add(room_id)
        room.on_final.append(lambda r: pair.rooms.discard(r.room))
        self._try_start(room)

    def ack(self, room_id: int, ok: bool, message: str = "") -> bool:
        room = self.rooms.get(room_id)
        if room is None:
            return False
        # NOTE: the acknowledgement may overtake the sender thread's own "sent" (the decode
        # side had the tail before this loop heard from the thread): both mean done
        if ok and room.state in (RoomState.TRANSFERRING, RoomState.WAITING_ACK):
            room.advance(RoomState.DONE)
        elif room.fail(message or "decode side refused the transfer", "wait_ack"):
            self.stats.failed("wait_ack")
        return True

    def abort(self, room_id: int, message: str) -> bool:
        room = self.rooms.get(room_id)
        if room is None:
            return False
        if room.fail(f"aborted by the decode side: {message}"):
            self.stats.failed(room.error.stage if room.error else "transfer")
        return True

    def _room_final(self, room: Room) -> None:
        export: KVExport | None = room.data.get("export")
        if export is not None:
            export.release()
        done: asyncio.Future[None] | None = room.data.get("done")
        if done is not None and not done.done():
            done.set_result(None)

    async def prefill(
        self, prompt_ids: Sequence[int], params: SamplingParams | None, rid: str, room_id: int
    ) -> GenerationChunk:
        """Run one room's request: prefill, hand the KV over, and return the first token's
        chunk once the decode side has it. Raises `RoomError` when the transfer fails,
        `RequestStalledError` when the answer took `stall_timeout_s`."""
        limit = self.config.stall_timeout_s
        try:
            return await asyncio.wait_for(self._prefill(prompt_ids, params, rid, room_id), limit)
        except TimeoutError:
            raise RequestStalledError("prefill", limit) from None

    async def _prefill(
        self, prompt_ids: Sequence[int], params: SamplingParams | None, rid: str, room_id: int
    ) -> GenerationChunk:
        export = self.engine.open_export(prompt_ids, params, rid)
        room = self._room(room_id)
        if "export" in room.data or room.final:
            export.release()
            raise RoomError("bootstrap", f"room {room_id} is in use")
        room.data["export"] = export
        room.data["done"] = asyncio.get_running_loop().create_future()
        try:
            last = await export.run()
            if last.error is not None or not export.held:
                room.fail(last.error or "prefill failed", "bootstrap")
                return last
            room.data["first"] = last
            self._try_start(room)
            await room.data["done"]
        except BaseException:
            room.fail("prefill request cancelled")
            raise
        if room.state is not RoomState.DONE:
            assert room.error is not None
            raise room.error
        return last

    def _try_start(self, room: Room) -> None:
        reg: Registration | None = room.data.get("registration")
        export: KVExport | None = room.data.get("export")
        if reg is None or export is None or "first" not in room.data:
            return
        if room.state is not RoomState.BOOTSTRAPPING:
            return
        pair = self.pairs.get(reg.pair_id)
        if pair is None or not pair.alive:
            room.fail("the pair with the decode server is gone", "bootstrap")
            return
        if reg.num_tokens != export.num_tokens or len(reg.pages) != len(export.pages):
            room.fail(
                f"decode reserved {len(reg.pages)} pages for {reg.num_tokens} tokens; the "
                f"prompt has {export.num_tokens} tokens in {len(export.pages)} pages",
                "bootstrap",
            )
            return
        room.advance(RoomState.TRANSFERRING, time.monotonic() + self.config.transfer_timeout_s)
        asyncio.get_running_loop().create_task(self._send(room, pair, export, reg))

    async def _send(self, room: Room, pair: _Pair, export: KVExport, reg: Registration) -> None:
        runs = contiguous_runs(export.pages, reg.pages)
        try:
            layers = await export.read([(s, n) for s, _, n in runs], pair.shards)
        except Exception as exc:
            room.fail(f"reading the KV failed: {exc}", "transfer")
            self.stats.failed("transfer")
            return
        if room.final:
            return
        cache = self.engine.core.ctx.kv_cache
        header = RoomHeader(
            room=room.room,
            num_tokens=export.num_tokens,
            num_layers=len(layers),
            head_dim=cache.row_width,  # a stored row, its scale included
            dtype=cache.dtype,
            page_size=self.engine.core.ctx.allocator.page_size,
            dst_runs=[(d, n) for _, d, n in runs],
            shard_heads=[b - a for a, b in pair.shards],
        )
        tail = RoomTail(room.room, export.token_ids[0], export.req.cached_tokens)
        fault = self.faults.plan() if self.faults is not None else TransferFault.NONE
        started = time.perf_counter()

        def job() -> None:
            try:
                _send_room(pair, header, layers, tail, fault, self.faults)
            except TransportError as exc:
                self._post(self._drop_pair, pair, str(exc))
                return
            seconds = time.perf_counter() - started
            self._post(self._sent, room, seconds, header.layer_bytes() * header.num_layers)

        pair.jobs.put(job)

    def _sent(self, room: Room, seconds: float, nbytes: int) -> None:
        self.stats.transferred(seconds, nbytes)
        if room.state is RoomState.TRANSFERRING:
            room.advance(RoomState.WAITING_ACK)


def _send_room(
    pair: _Pair,
    header: RoomHeader,
    layers: list[list[tuple[torch.Tensor, torch.Tensor]]],
    tail: RoomTail,
    fault: TransferFault,
    faults: TransferFaults | None,
) -> None:
    """On the pair's sender thread: one room's header, layers and tail."""
    channel = pair.channel
    assert channel is not None
    if fault is TransferFault.DROP:
        return
    if fault is TransferFault.DELAY and faults is not None:
        time.sleep(faults.config.kv_delay_seconds)
    if fault is TransferFault.WRONG_ROOM:
        header.room ^= 1
        tail.room ^= 1
    send_header(channel, header)
    for i, per_rank in enumerate(layers):
        send_layer(channel, per_rank)
        if i == 0 and fault is TransferFault.KILL:
            logger.error("injected fault: the prefill server dies mid-transfer")
            os._exit(17)
    send_tail(channel, tail)
