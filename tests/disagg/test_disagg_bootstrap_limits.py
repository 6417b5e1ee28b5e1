"""The prefill's bootstrap endpoint bounded like the API (issue 42, findings 4, 5 and 14): the
shared secret before anything else, a body limit, rooms per decode server and in total, a pair
nobody joins dropped after `pair_timeout_s` (it held a slot for the 3,600 s group timeout), a
rendezvous nobody can list or overwrite; and on the decode side, garbage from a prefill's
endpoint is a 502 naming it, never a 500. Each limit is tested at the value served and the one
refused."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from stallfree import Engine
from stallfree.disagg.bootstrap import BootstrapServer
from stallfree.disagg.guard import SECRET_HEADER, warn_if_open
from stallfree.disagg.prefill import PrefillSide
from tests.disagg.test_disagg_trust import _body, decode_server
from tests.engine_util import engine_config, settle

SECRET = "bootstrap-secret-for-tests"
JSON = {"content-type": "application/json"}


@contextlib.asynccontextmanager
async def bootstrap(
    llama: str, **disagg: Any
) -> AsyncIterator[tuple[PrefillSide, httpx.AsyncClient]]:
    cfg = engine_config(llama, disaggregation={"mode": "prefill", **disagg})
    async with Engine(cfg) as engine:
        side = PrefillSide(engine, cfg.disaggregation, backend="gloo")
        await side.start()
        server = BootstrapServer(side, "127.0.0.1", 0)
        await server.start()
        headers = {SECRET_HEADER: cfg.disaggregation.secret or ""}
        client = httpx.AsyncClient(base_url=server.url, headers=headers, timeout=10)
        try:
            yield side, client
        finally:
            await client.aclose()
            await server.stop()
            await side.close()


async def _pair(side: PrefillSide, client: httpx.AsyncClient) -> str:
    body = {
        "fingerprint": side.fingerprint.model_dump(),
        "shards": [[0, side.fingerprint.num_kv_heads]],
    }
    r = await client.post("/bootstrap/pair", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["pair_id"])


def _register(pair_id: str) -> dict[str, Any]:
    return {"pair_id": pair_id, "pages": [1], "num_tokens": 1}


async def test_every_call_but_health_needs_the_secret(llama: str) -> None:
    async with bootstrap(llama, secret=SECRET) as (side, client):
        pair_id = await _pair(side, client)  # with the secret
        calls = [
            ("GET", "/bootstrap/info", None),
            ("POST", "/bootstrap/pair", {}),
            ("POST", "/bootstrap/rooms/5", _register(pair_id)),
            ("POST", "/bootstrap/rooms/5/ack", {"ok": True}),
            ("POST", "/bootstrap/rooms/5/abort", {}),
            ("GET", f"/bootstrap/pairs/{pair_id}/store?key=0/0", None),
            ("POST", f"/bootstrap/pairs/{pair_id}/store?key=0/1", {"value": "AA=="}),
        ]
        for headers in (
            {SECRET_HEADER: ""},
            {SECRET_HEADER: SECRET + "x"},
            {SECRET_HEADER: SECRET[:-1]},
        ):
            for method, path, body in calls:
                r = await client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, r.status_code)
                assert SECRET_HEADER in r.json()["error"]["message"]
        store = side.pair_store(pair_id)
        assert len(side.rooms) == 0 and store is not None and store.peek("0/1") is None
        bare = httpx.AsyncClient(base_url=str(client.base_url))
        assert (await bare.get("/health")).status_code == 200
        await bare.aclose()
        assert (await client.get("/bootstrap/info")).status_code == 200


def test_an_open_endpoint_beyond_loopback_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    assert warn_if_open("0.0.0.0", None)
    assert "without disaggregation.secret" in caplog.text
    assert not warn_if_open("0.0.0.0", SECRET)
    assert not warn_if_open("127.0.0.1", None) and not warn_if_open("::1", None)


async def test_body_limit_at_its_edge(llama: str) -> None:
    limit = 1024
    async with bootstrap(llama, bootstrap_max_body_bytes=limit) as (_, client):

        def ack(size: int) -> bytes:
            head, tail = b'{"ok":true,"message":"', b'"}'
            return head + b"m" * (size - len(head) - len(tail)) + tail

        served = await client.post("/bootstrap/rooms/5/ack", content=ack(limit), headers=JSON)
        assert served.status_code == 200, served.text
        refused = await client.post("/bootstrap/rooms/5/ack", content=ack(limit + 1), headers=JSON)
        assert refused.status_code == 413 and str(limit) in refused.text


async def test_rooms_per_pair_at_its_edge(llama: str) -> None:
    async with bootstrap(llama, max_rooms_per_pair=2) as (side, client):
        pair_id = await _pair(side, client)
        for room in (1, 2):
            r = await client.post(f"/bootstrap/rooms/{room}", json=_register(pair_id))
            assert r.status_code == 200, r.text
        r = await client.post("/bootstrap/rooms/3", json=_register(pair_id))
        assert r.status_code == 429 and "max_rooms_per_pair=2" in r.text, r.text
        # a room that ends gives its place back
        assert (await client.post("/bootstrap/rooms/1/abort", json={})).status_code == 200
        r = await client.post("/bootstrap/rooms/3", json=_register(pair_id))
        assert r.status_code == 200, r.text
        assert sorted(room.room for room in side.rooms) == [2, 3]


async def test_rooms_in_total_at_its_edge(llama: str) -> None:
    async with bootstrap(llama, max_rooms=2) as (side, client):
        a, b = await _pair(side, client), await _pair(side, client)
        assert (await client.post("/bootstrap/rooms/1", json=_register(a))).status_code == 200
        assert (await client.post("/bootstrap/rooms/2", json=_register(b))).status_code == 200
        r = await client.post("/bootstrap/rooms/3", json=_register(b))
        assert r.status_code == 429 and "max_rooms=2" in r.text, r.text
        assert len(side.rooms) == 2


async def test_a_pair_nobody_joins_is_dropped_after_pair_timeout(llama: str) -> None:
    async with bootstrap(llama, pair_timeout_s=0.5) as (side, client):
        pair_id = await _pair(side, client)
        assert pair_id in side.pairs
        deadline = time.monotonic() + 20
        while pair_id in side.pairs:
            assert time.monotonic() < deadline, "the unjoined pair was never dropped"
            await asyncio.sleep(0.05)
        r = await client.post("/bootstrap/rooms/1", json=_register(pair_id))
        assert r.status_code == 404


async def test_the_rendezvous_is_write_once_and_per_pair(llama: str) -> None:
    async with bootstrap(llama, pair_timeout_s=30) as (side, client):
        pair_id = await _pair(side, client)
        path = f"/bootstrap/pairs/{pair_id}/store"
        # rank 0 (the prefill) writes its address first
        deadline = time.monotonic() + 10
        while (r := await client.get(path, params={"key": "0/0"})).status_code != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        r = await client.post(path, params={"key": "0/0"}, json={"value": "AAAA"})
        assert r.status_code == 409 and "written already" in r.text
        unknown = "0" * 32
        r = await client.get(f"/bootstrap/pairs/{unknown}/store", params={"key": "0/0"})
        assert r.status_code == 404
        r = await client.post(
            f"/bootstrap/pairs/{unknown}/store", params={"key": "0/1"}, json={"value": "AA=="}
        )
        assert r.status_code == 404
        # no TCPStore to list: the endpoint answers nothing but /bootstrap/... routes
        assert "store_port" not in (await client.get("/bootstrap/info")).json()


# ---------------------------------------------------------------------- finding 14


class GarbagePrefill:
    """A listed bootstrap endpoint that answers 200 with what is not its protocol."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.server: asyncio.base_events.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(self.body), self.body)
            )
            await writer.drain()
        writer.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"<html>not json</html>", id="not-json"),
        pytest.param(b"[1, 2, 3]", id="not-an-object"),
        pytest.param(b'{"role": "prefill"}', id="no-fingerprint"),
        pytest.param(
            b'{"role": "prefill", "fingerprint": {"x": 1}, "backend": "gloo"}', id="bad-fingerprint"
        ),
    ],
)
async def test_garbage_from_a_prefill_is_a_502_naming_it(llama: str, body: bytes) -> None:
    async with (
        GarbagePrefill(body) as port,
        decode_server(llama, [f"127.0.0.1:{port}"]) as (engine, client),
    ):
        upstream = f"prefill bootstrap 127.0.0.1:{port}"
        r = await client.post("/v1/completions", json=_body("127.0.0.1", port, 9))
        assert r.status_code == 502, r.text
        assert upstream in r.json()["error"]["message"] and "Traceback" not in r.text
        r = await client.post(
            "/disagg/connect", json={"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        )
        assert r.status_code == 502 and upstream in r.text, r.text
        assert (await client.get("/health")).status_code == 200
        await settle(engine)


async def test_a_registration_is_parsed_off_the_loop_and_checked(
    llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stallfree.disagg.bootstrap import RegisterBody
    from stallfree.disagg.rooms import MAX_ROOM

    threads: list[str] = []
    parse = RegisterBody.model_validate_json

    def recording(data: Any) -> RegisterBody:
        threads.append(threading.current_thread().name)
        return parse(data)

    monkeypatch.setattr(RegisterBody, "model_validate_json", recording)
    async with bootstrap(llama) as (side, client):
        pair_id = await _pair(side, client)
        served = await client.post(f"/bootstrap/rooms/{MAX_ROOM}", json=_register(pair_id))
        assert served.status_code == 200 and served.json() == {"room": MAX_ROOM}, served.text
        assert threads and threading.main_thread().name not in threads
        for path, body in (
            (f"/bootstrap/rooms/{MAX_ROOM + 1}", _register(pair_id)),
            ("/bootstrap/rooms/-1", _register(pair_id)),
            ("/bootstrap/rooms/x", _register(pair_id)),
            ("/bootstrap/rooms/6", {"pair_id": pair_id}),
            ("/bootstrap/rooms/6", [1, 2]),
            ("/bootstrap/rooms/6", {"pair_id": pair_id, "pages": [1 << 70], "num_tokens": 1}),
            ("/bootstrap/rooms/6", {"pair_id": pair_id, "pages": [1], "num_tokens": 1 << 20}),
        ):
            r = await client.post(path, json=body)
            assert r.status_code == 422, (path, r.status_code, r.text)
        r = await client.post("/bootstrap/rooms/6", content=b"{not json", headers=JSON)
        assert r.status_code == 422, r.text
        assert [room.room for room in side.rooms] == [MAX_ROOM]


async def test_a_decode_server_pairs_only_with_the_shared_secret(llama: str) -> None:
    async with bootstrap(llama, secret=SECRET) as (side, client):
        port = int(str(client.base_url).rsplit(":", 1)[1])
        connect = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        for wrong in (None, SECRET + "-not"):
            secret = {} if wrong is None else {"secret": wrong}
            async with decode_server(llama, [], **secret) as (engine, decode):
                r = await decode.post("/disagg/connect", json=connect)
                assert r.status_code == 502 and "answered HTTP 401" in r.text, r.text
                r = await decode.post("/v1/completions", json=_body("127.0.0.1", port, 41))
                assert r.status_code == 503 and "answered HTTP 401" in r.text, r.text
                await settle(engine)
        assert side.pairs == {}  # nobody without the secret got a pair
        async with decode_server(llama, [], secret=SECRET) as (engine, decode):
            r = await decode.post("/disagg/connect", json=connect)
            assert r.status_code == 200 and r.json()["status"] == "paired", r.text
            assert list(side.pairs) == [r.json()["pair_id"]]
            await settle(engine)


async def test_pairs_nobody_joins_hold_their_slots_only_until_pair_timeout(llama: str) -> None:
    """Finding 4: 64 pairing calls that never join held every slot for the 3,600 s group
    timeout. The 64th pair is served, the 65th refused, and once the unjoined pairs' deadline
    has passed a new one is served again."""
    from stallfree.disagg.prefill import MAX_PAIRS

    async with bootstrap(llama, pair_timeout_s=1.0) as (side, client):
        for _ in range(MAX_PAIRS):
            await _pair(side, client)
        body = {
            "fingerprint": side.fingerprint.model_dump(),
            "shards": [[0, side.fingerprint.num_kv_heads]],
        }
        r = await client.post("/bootstrap/pair", json=body)
        assert r.status_code == 409 and f"at most {MAX_PAIRS}" in r.text, r.text
        deadline = time.monotonic() + 30
        while side.pairs:
            assert time.monotonic() < deadline, f"{len(side.pairs)} unjoined pairs were kept"
            await asyncio.sleep(0.1)
        await _pair(side, client)


async def test_a_registration_holds_at_most_the_prefills_pool(llama: str) -> None:
    """A registration's pages stay in memory until its room ends: no more than any prompt here
    could have (this server's pool), the pool's size served and one more page refused."""
    async with bootstrap(llama) as (side, client):
        pair_id = await _pair(side, client)
        allocator = side.engine.core.ctx.allocator
        pool = allocator.num_pages

        def reg(pages: int) -> dict[str, Any]:
            return {"pair_id": pair_id, "pages": list(range(1, pages + 1)), "num_tokens": 1}

        assert (await client.post("/bootstrap/rooms/7", json=reg(pool))).status_code == 200
        r = await client.post("/bootstrap/rooms/8", json=reg(pool + 1))
        assert r.status_code == 422 and f"this server's {pool} pages" in r.text, r.text
        assert [room.room for room in side.rooms] == [7]
