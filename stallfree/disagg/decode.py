"""The decode server's side: pair with a prefill server (handshake once per peer), reserve a
room's slot and pages on the host, tell the prefill where they are, write each arriving layer on
the stream, then join the decode batch with the first token and decode.

Each paired prefill has one receiver thread reading its channel: a room's header, its layers,
its tail. What arrives for a room this side does not expect (a wrong room id, a room that has
failed) is read and dropped, so the channel stays in step. The pages are written only on the
stream, from the loop, and only while the room is transferring: a failed room's pages are
freed at once, since no transfer writes them behind the stream's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.config import DisaggregationConfig
from stallfree.disagg.bootstrap import BAD_UPSTREAM, ControlError, HttpControl, PrefillControl
from stallfree.disagg.fingerprint import HandshakeError
from stallfree.disagg.rooms import RequestStalledError, Room, RoomError, RoomState
from stallfree.disagg.side import RoomSide
from stallfree.disagg.transport import (
    KVChannel,
    KVLayout,
    RoomHeader,
    RoomTail,
    TransportError,
    recv_header,
    recv_layer,
    recv_tail,
)
from stallfree.disagg.trust import PrefillAllowList
from stallfree.runtime.engine import Engine
from stallfree.runtime.handoff import KVImport
from stallfree.runtime.model.parallel import kv_head_range
from stallfree.runtime.request.outputs import GenerationChunk
from stallfree.runtime.request.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PREALLOC_RETRY_S = 0.005


@dataclass(eq=False)
class _Link:
    """A paired prefill server: its control client, the pair's channel and receiver."""

    key: tuple[str, int]
    control: PrefillControl
    pair_id: str = ""
    channel: KVChannel | None = None
    alive: bool = True
    misses: int = 0
    heartbeat: asyncio.Task[None] | None = None
    # the room the receiver is reading now (None: dropping what arrives)
    current: Room | None = None
    layers_seen: int = 0
    rooms: set[int] = field(default_factory=set)


class DecodeSide(RoomSide):
    def __init__(
        self,
        engine: Engine,
        config: DisaggregationConfig,
        controls: Callable[[str, int], PrefillControl] | None = None,
    ) -> None:
        super().__init__(engine, "decode")
        self.config = config
        self.trusted = PrefillAllowList(config.prefill_hosts)
        self._links: dict[tuple[str, int], _Link] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        device = engine.core.ctx.kv_cache.device
        self._controls = controls or (lambda host, port: HttpControl(host, port, device, config))
        self.wrong_rooms = 0  # transfers that arrived for no room this side expects

    async def close(self) -> None:
        await self._stop("decode server shutting down")
        for link in list(self._links.values()):
            self._break(link, "decode server shutting down")
            await link.control.close()

    def shards(self) -> list[list[int]]:
        """The KV-head range each of this server's tensor-parallel ranks holds."""
        arch, tp = self.engine.core.arch, self.engine.config.parallel.tp_size
        return [list(kv_head_range(arch, r, tp)) for r in range(tp)]

    def layout(self) -> KVLayout:
        """What this server's receivers take (checked before each receive is posted)."""
        core = self.engine.core
        return KVLayout(
            num_layers=core.arch.num_layers,
            head_dim=core.ctx.kv_cache.row_width,  # a stored row, its scale included
            dtype=core.ctx.kv_cache.dtype,
            page_size=core.ctx.allocator.page_size,
            shard_heads=[b - a for a, b in self.shards()],
            num_pages=core.ctx.allocator.num_pages,
        )

    # ------------------------------------------------------------------ pairing

    async def connect(self, host: str, port: int) -> _Link:
        """Pair with the prefill at `host:port` (once; later calls reuse the pair). Raises
        `UntrustedPrefillError` for a prefill not in `disaggregation.prefill_hosts` (nothing is
        contacted), `HandshakeError` naming what differs when the two cannot work together."""
        self.trusted.check(host, port)
        key = (host, port)
        link = self._links.get(key)
        if link is not None and link.alive:
            return link
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            link = self._links.get(key)
            if link is not None and link.alive:
                return link
            control = self._controls(host, port)
            try:
                link = await self._pair(key, control)
            except BaseException:
                await control.close()
                raise
            self._links[key] = link
            return link

    async def _pair(self, key: tuple[str, int], control: PrefillControl) -> _Link:
        info = await control.pair_info()
        if info.role != "prefill":
            raise HandshakeError(f"{control.label} is not a prefill server")
        info.fingerprint.check_decode(self.fingerprint)
        if info.backend == "nccl" and self.engine.config.uses_worker_processes:
            raise HandshakeError(
                "the prefill sends over NCCL, which this decode server's host cannot receive: "
                "its KV lives in worker processes (tp_size > 1); use gloo on the prefill"
            )
        try:
            pair = await control.pair(self.fingerprint, self.shards())
        except ControlError as exc:
            if exc.status == 409:
                raise HandshakeError(str(exc)) from exc
            raise
        link = _Link(key, control, pair["pair_id"])
        link.channel = await control.channel(pair, info.model_dump())
        threading.Thread(
            target=self._receive,
            args=(link,),
            name=f"stallfree-kv-recv-{link.pair_id[:8]}",
            daemon=True,
        ).start()
        link.heartbeat = asyncio.create_task(self._heartbeat(link))
        return link

    async def _heartbeat(self, link: _Link) -> None:
        cfg = self.config
        while link.alive:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            if await link.control.health():
                link.misses = 0
                continue
            link.misses += 1
            if link.misses >= cfg.heartbeat_max_failures:
                self._break(link, f"{link.control.label} stopped answering its heartbeat")

    def _break(self, link: _Link, why: str) -> None:
        """The pair is gone: every room on it fails; the next request pairs anew."""
        if not link.alive:
            return
        link.alive = False
        if self._links.get(link.key) is link:
            del self._links[link.key]
        for room_id in list(link.rooms):
            room = self.rooms.get(room_id)
            if room is not None and room.fail(f"prefill lost: {why}"):
                self.stats.failed(room.error.stage if room.error else "transfer")
        if link.heartbeat is not None and link.heartbeat is not asyncio.current_task():
            link.heartbeat.cancel()
        if link.channel is not None:
            link.channel.close()

    # ------------------------------------------------------------------ the receiver

    def _receive(self, link: _Link) -> None:
        """The pair's receiver thread: rooms, one after another, posted to the loop."""
        channel = link.channel
        assert channel is not None
        layout = self.layout()
        try:
            while link.alive:
                header = recv_header(channel, layout)
                self._post(self._on_header, link, header)
                for layer in range(header.num_layers):
                    ks, vs = recv_layer(channel, header)
                    self._post(self._on_layer, link, header, layer, ks, vs)
                self._post(self._on_tail, link, recv_tail(channel))
        except TransportError as exc:
            if link.alive:
                self._post(self._break, link, str(exc))
        except Exception as exc:  # a bug here must not leave the rooms waiting
            logger.exception("KV receiver failed")
            self._post(self._break, link, f"receiver failed: {exc!r}")

    def _on_header(self, link: _Link, h: RoomHeader) -> None:
        link.current, link.layers_seen = None, 0
        room = self.rooms.get(h.room)
        if room is None or room.room not in link.rooms:
            self.wrong_rooms += 1
            logger.warning("dropping a KV transfer for room %d, which is not expected", h.room)
            return
        if room.state is not RoomState.TRANSFERRING:
            return  # failed or expired meanwhile: drop what arrives
        imp: KVImport = room.data["import"]
        # NOTE: the receiver checked the header's sizes against this server's layout already
        problem = (
            f"{h.num_tokens} tokens, not {len(imp.req.origin_input_ids)}"
            if h.num_tokens != len(imp.req.origin_input_ids)
            else None
        )
        if problem is None and sorted(p + i for p, n in h.dst_runs for i in range(n)) != sorted(
            imp.pages
        ):
            problem = "pages this room does not hold"
        if problem is not None:
            if room.fail(f"transfer header does not match the room: {problem}", "transfer"):
                self.stats.failed("transfer")
            return
        link.current = room

    def _on_layer(
        self,
        link: _Link,
        h: RoomHeader,
        layer: int,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
    ) -> None:
        room = link.current
        if room is None or room.state is not RoomState.TRANSFERRING:
            return
        try:
            room.data["import"].write_layer(layer, h.dst_runs, ks, vs)
        except Exception as exc:
            if room.fail(f"writing layer {layer} failed: {exc}", "transfer"):
                self.stats.failed("transfer")
            return
        link.layers_seen += 1
        room.data["bytes"] = room.data.get("bytes", 0) + sum(t.nbytes for t in (*ks, *vs))

    def _on_tail(self, link: _Link, tail: RoomTail) -> None:
        room, link.current = link.current, None
        if room is None or room.state is not RoomState.TRANSFERRING:
            return
        if tail.room != room.room or link.layers_seen != self.engine.core.arch.num_layers:
            if room.fail("transfer tail does not match its header", "transfer"):
                self.stats.failed("transfer")
            return
        room.data["first_token"] = tail.first_token
        room.data["cached_tokens"] = tail.cached_tokens
        self.stats.transferred(time.monotonic() - room.data["since"], room.data.get("bytes", 0))
        room.advance(RoomState.DONE)

    # ------------------------------------------------------------------ one request

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None,
        rid: str,
        room_id: int,
        host: str,
        port: int,
    ) -> AsyncIterator[GenerationChunk]:
        """Decode one room's request: its chunks, the first being the prefill's token. Raises
        `UntrustedPrefillError`, `HandshakeError` or `RoomError` (with the stage) when it
        cannot, `RequestStalledError` when no chunk came for `stall_timeout_s` (whatever held
        it up: the room is failed and its pages freed as for any other end)."""
        self.trusted.check(host, port)
        chunks = self._generate(prompt_ids, params, rid, room_id, host, port)
        limit = self.config.stall_timeout_s
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(chunks), limit)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise RequestStalledError("decode", limit) from None
                yield chunk
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    async def _generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None,
        rid: str,
        room_id: int,
        host: str,
        port: int,
    ) -> AsyncIterator[GenerationChunk]:
        imp = self.engine.open_import(prompt_ids, params, rid)  # checks the request first
        room, done = self._open_room(imp, room_id)
        link: _Link | None = None
        joined = False
        try:
            link = await self._until(room, done, self.connect(host, port))
            link.rooms.add(room_id)
            first = await self._receive_kv(room, done, imp, link, len(prompt_ids))
            asyncio.get_running_loop().create_task(self._quiet(link.control.ack(room_id, True)))
            joined = True
            chunks = imp.join(first)
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
        except HandshakeError:
            room.fail("handshake refused", "bootstrap")
            raise
        except ControlError as exc:
            stage = self._control_failed(room, link, exc)
            if exc.status == BAD_UPSTREAM:
                raise  # the server answers a 502 naming the prefill
            raise room.error or RoomError(stage, str(exc)) from exc
        finally:
            if link is not None:
                link.rooms.discard(room_id)
            if not joined:
                self._abandon(room, imp, link)

    def _open_room(self, imp: KVImport, room_id: int) -> tuple[Room, asyncio.Future[None]]:
        """The room `imp` arrives in (the import cancelled when the id is in use), and a future
        that resolves when the room ends."""
        try:
            room = self.rooms.open(
                room_id, RoomState.BOOTSTRAPPING, self.config.bootstrap_timeout_s
            )
        except KeyError as exc:
            imp.cancel()
            raise RoomError("bootstrap", f"room {room_id} is in use") from exc
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        room.data["import"] = imp
        room.on_final.append(lambda _: _resolve(done))
        return room, done

    async def _receive_kv(
        self, room: Room, done: asyncio.Future[None], imp: KVImport, link: _Link, num_tokens: int
    ) -> int:
        """Reserve the room's pages, register them with the prefill and wait until its KV has
        arrived; the prefill's first token."""
        room.advance(RoomState.PREALLOC)
        while not imp.reserve():
            await self._until(room, done, asyncio.sleep(PREALLOC_RETRY_S))
        room.advance(RoomState.TRANSFERRING, time.monotonic() + self.config.transfer_timeout_s)
        room.data["since"] = time.monotonic()
        await self._until(
            room, done, link.control.register(room.room, link.pair_id, imp.pages, num_tokens)
        )
        await done
        if room.state is not RoomState.DONE:
            raise room.error or RoomError(room.state.value, "room ended")
        first: int = room.data["first_token"]
        return first

    def _control_failed(self, room: Room, link: _Link | None, exc: ControlError) -> str:
        """Fail the room on the prefill's refusal or silence (and drop the pair when the
        prefill has forgotten it); the stage the room failed in."""
        if exc.status == 404 and link is not None:  # the prefill forgot the pair
            self._break(link, str(exc))
        stage = room.state.value
        if room.fail(str(exc), stage):
            self.stats.failed(stage)
        return stage

    def _abandon(self, room: Room, imp: KVImport, link: _Link | None) -> None:
        """A request that ended before its KV arrived: fail its room, free its pages, and tell
        the prefill (best effort)."""
        if room.fail("decode request ended before its KV arrived"):
            self.stats.failed(room.error.stage if room.error else "transfer")
        imp.cancel()
        if link is not None and link.alive:
            why = str(room.error) if room.error else "aborted"
            asyncio.get_running_loop().create_task(self._quiet(link.control.abort(room.room, why)))

    async def _until(self, room: Room, done: asyncio.Future[None], aw: Any) -> Any:
        """Await `aw` unless the room ends first: raise its error if it failed (its deadline, a
        broken pair); return None if its KV arrived, which only the registration's reply can
        be overtaken by (the prefill sends once it has the registration)."""
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait({task, done}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if room.state is RoomState.DONE:
            # NOTE: the receiver thread's posts may run before the registration's reply
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return None
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise room.error or RoomError(room.state.value, "room ended")

    @staticmethod
    async def _quiet(aw: Any) -> None:
        """Best effort (an acknowledgement, an abort): the prefill's deadline covers a loss."""
        with contextlib.suppress(ControlError, asyncio.CancelledError):
            await aw


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)
