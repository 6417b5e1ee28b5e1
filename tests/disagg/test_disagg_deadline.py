"""Every disaggregated request has a deadline for progress (issue 42, finding 9: a PD request
could stall 60-120 s with no deadline of its own): `disaggregation.stall_timeout_s`, applied on
both sides whatever holds the request up. Here the room deadlines are a minute, so what ends the
request is the stall deadline: a clean error, pages freed, the servers go on serving."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stallfree.disagg.rooms import RequestStalledError
from tests.disagg.disagg_util import engine_pair
from tests.disagg.test_disagg_faults import PARAMS, PROMPT, _decode_only, all_free, still_serves
from tests.disagg.test_disagg_trust import _body, decode_server

STALL_S = 0.5
LIVENESS_S = 10.0  # far inside the rooms' 60 s deadlines
SLOW_ROOMS: dict[str, Any] = {
    "disaggregation": {
        "bootstrap_timeout_s": 60.0,
        "transfer_timeout_s": 60.0,
        "stall_timeout_s": STALL_S,
    }
}


async def test_a_stalled_prefill_ends_the_decode_request_at_the_stall_deadline(llama: str) -> None:
    async with engine_pair(llama, **SLOW_ROOMS) as pair:
        # the prefill never runs this room's request: its KV never comes
        task = asyncio.ensure_future(_decode_only(pair, 31))
        with pytest.raises(
            RequestStalledError, match=r"decode request made no progress for 0\.5 s"
        ):
            await asyncio.wait_for(task, LIVENESS_S)
        assert len(pair.d.rooms) == 0
        await asyncio.sleep(0.1)  # the abort the decode side sent reaches the prefill
        await still_serves(pair, 32)
        await all_free(pair)


async def test_a_prefill_request_nobody_decodes_ends_at_the_stall_deadline(llama: str) -> None:
    async with engine_pair(llama, **SLOW_ROOMS) as pair:
        with pytest.raises(RequestStalledError, match="prefill request made no progress"):
            await asyncio.wait_for(pair.p.prefill(PROMPT, PARAMS, "p33", 33), LIVENESS_S)
        assert len(pair.p.rooms) == 0
        await still_serves(pair, 34)
        await all_free(pair)


async def test_the_decode_server_answers_a_stall_with_a_504(llama: str) -> None:
    # a listed prefill that accepts the connection and never answers
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(LIVENESS_S)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    try:
        async with decode_server(llama, [f"127.0.0.1:{port}"], **SLOW_ROOMS["disaggregation"]) as (
            _,
            client,
        ):
            r = await client.post("/v1/completions", json=_body("127.0.0.1", port, 35))
            assert r.status_code == 504, r.text
            assert "disaggregation.stall_timeout_s" in r.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 200
    finally:
        server.close()
        await server.wait_closed()
