"""The router's own SSE event (a leg that failed after the stream started) is one line by every
reader's rules: U+0085, U+2028 and U+2029 in the upstream's error are written as JSON escapes,
as the servers write theirs (issue 42)."""

from __future__ import annotations

import json

from tests.router.test_router import PROMPT


async def test_an_error_event_escapes_the_unicode_line_breaks(cluster) -> None:
    c = await cluster()
    prefill, decode = c.prefill[0], c.decode[0]
    prefill.name = "p\x85\u2028\u2029"  # the fake's error says "<name> says no"
    decode.mode = "slow"
    prefill.mode, prefill.gate = "error", decode.first_sent
    async with c.http.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as resp:
        assert resp.status_code == 200
        raw = b"".join([chunk async for chunk in resp.aiter_bytes()]).decode()
    lines = [line for line in raw.splitlines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["message"] == "p\x85\u2028\u2029 says no"
