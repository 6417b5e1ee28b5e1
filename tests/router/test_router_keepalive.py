"""The router lets an idle upstream connection go before a server would close it: a pooled
connection reused just as the server closes it (keep-alive 5 s on our servers, uvicorn's and
vLLM's; httpx kept them 5 s too) failed its request with a ReadError, a 502 or a cut stream.
A 1,000-request PD soak (benchmarks/pd_soak.py) lost 4 to 7 requests so; with the servers
keeping connections 30 s instead, none. A leg that meets such a connection is sent again on a
fresh one (stale_connections.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from stallfree.config.server import ServerConfig
from stallfree.entrypoints.router.dispatch import KEEPALIVE_S
from stallfree.entrypoints.router.stale_connections import STALE, send_fresh_on_stale


async def test_the_routers_idle_connections_expire_before_the_servers_keep_alive(cluster) -> None:
    c = await cluster()
    assert c.running is not None
    pool = c.running.router.client._transport._pool  # httpcore's pool: what httpx was given
    assert pool._keepalive_expiry == KEEPALIVE_S
    assert ServerConfig().keep_alive_s >= 2 * KEEPALIVE_S
    resp = await c.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert resp.status_code == 200, resp.text


async def _closes_the_second_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Answers a connection's first request and keeps it open; on its second, closes it
    unanswered, as a server whose keep-alive ran out as the request came."""
    served = 0
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n")
             if line.lower().startswith(b"content-length:")),
            0,
        )  # fmt: skip
        await reader.readexactly(length)
        if served:
            writer.close()
            return
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()


async def test_a_request_sent_on_a_connection_the_server_closed_goes_out_again() -> None:
    server = await asyncio.start_server(_closes_the_second_request, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            first = client.build_request("POST", url, content=b"{}")
            assert (await send_fresh_on_stale(client, first)).text == "ok"
            again = client.build_request("POST", url, content=b'{"n": 2}')
            resp = await send_fresh_on_stale(client, again)  # the pooled connection, closed
            assert resp.status_code == 200 and resp.text == "ok"
            plain = client.build_request("POST", url, content=b"{}")
            with pytest.raises(STALE):  # what the router's legs got before: a 502
                await client.send(plain)
    finally:
        server.close()
        await server.wait_closed()
