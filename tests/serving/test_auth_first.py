"""The API key is checked on the request head, before the request is counted or its body read;
the Host check parses the header strictly; a 404 never echoes a client's id at length."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from stallfree.entrypoints.server.transport.guard import _hostname
from tests.server_util import serving

KEY = "s3cret"


async def _slow_keyless_body(url: str, hold: asyncio.Event) -> bytes:
    """A request without the key that promises a body and sends one byte of it, then waits:
    what comes back before the body arrives is all the server answers to its head."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )
    await writer.drain()
    try:
        answer = await asyncio.wait_for(reader.read(65536), timeout=10)
        closed = await asyncio.wait_for(reader.read(65536), timeout=10)  # b"": closed by server
        return answer + (b"<closed>" if closed == b"" else closed)
    finally:
        hold.set()
        writer.close()


async def test_keyless_slow_bodies_get_401_at_once_and_hold_no_slot(llama):
    limits = {"max_concurrent_requests": 2, "body_timeout_s": 30}
    async with serving(llama, api_key=KEY, server=limits) as live:
        hold = asyncio.Event()
        answers = await asyncio.gather(
            *(_slow_keyless_body(live.server.url, hold) for _ in range(6))
        )
        for answer in answers:
            head = answer.split(b"\r\n", 1)[0]
            assert head == b"HTTP/1.1 401 Unauthorized", answer[:200]
            assert b"connection: close" in answer.lower() and answer.endswith(b"<closed>")
            assert b"invalid_api_key" in answer
        # keyed requests are served meanwhile: the keyless ones never took a slot
        ok = await live.http.post(
            "/v1/completions", json={"model": "test-model", "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200


async def test_malformed_json_without_the_key_is_401_not_400(llama):
    async with (
        serving(llama, api_key=KEY) as live,
        httpx.AsyncClient(base_url=live.server.url) as anonymous,
    ):
        bad = await anonymous.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        wrong = await anonymous.post(
            "/v1/completions", content=b"{not json", headers={"Authorization": "Bearer nope"}
        )
        lower = await anonymous.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})
    assert bad.status_code == wrong.status_code == 401
    assert bad.headers["connection"] == "close"
    assert "missing API key" in bad.json()["error"]["message"]
    assert wrong.json()["error"]["message"] == "invalid API key"
    assert lower.status_code == 200  # the scheme is case-insensitive


@pytest.mark.parametrize(
    ("header", "host"),
    [
        (b"localhost", "localhost"),
        (b"LocalHost:8000", "localhost"),
        (b"localhost.", "localhost"),
        (b"localhost.:80", "localhost"),
        (b"[::1]:8000", "::1"),
        (b"[::1]", "::1"),
        (b"localhost:abc", None),
        (b"localhost:", None),
        (b"[localhost]", None),
        (b"[::1]x", None),
        (b"[::1", None),
    ],
)
def test_host_headers_parse_strictly(header, host):
    assert _hostname(header) == host


async def test_allowed_hosts_takes_the_dotted_name_and_refuses_a_bad_port(llama):
    async with serving(llama, server={"allowed_hosts": ["localhost"]}) as live:
        dotted = await live.http.get("/v1/models", headers={"host": "localhost."})
        bad_port = await live.http.get("/v1/models", headers={"host": "localhost:abc"})
        bracketed = await live.http.get("/v1/models", headers={"host": "[localhost]"})
    assert dotted.status_code == 200
    assert bad_port.status_code == bracketed.status_code == 400
    assert bad_port.json()["error"]["code"] == "invalid_host"


async def test_an_unknown_model_id_is_not_echoed_at_length(llama):
    async with serving(llama) as live:
        huge = "m" * 15_000  # within the 16 KiB request head
        answer = await live.http.get(f"/v1/models/{huge}")
    assert answer.status_code == 404
    assert len(answer.content) < 1_000
    assert "14936 more characters" in answer.json()["error"]["message"]


async def test_any_of_several_api_keys_is_accepted_and_no_other(llama):
    body = {"model": "test-model", "prompt": "hi", "max_tokens": 2}
    async with (
        serving(llama, server={"api_key": ["first-key", "second-key"]}) as live,
        httpx.AsyncClient(base_url=live.server.url) as anonymous,
    ):
        for key, status in [("first-key", 200), ("second-key", 200), ("first-keyx", 401)]:
            headers = {"Authorization": f"Bearer {key}"}
            r = await anonymous.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == status, (key, r.text[:200])
        assert (await anonymous.post("/v1/completions", json=body)).status_code == 401


def test_an_empty_list_of_api_keys_is_refused():
    from pydantic import ValidationError

    from stallfree.config import ServerConfig

    with pytest.raises(ValidationError, match="list of API keys is empty"):
        ServerConfig(api_key=[])
    with pytest.raises(ValidationError, match="API key is empty"):
        ServerConfig(api_key=["ok", ""])
