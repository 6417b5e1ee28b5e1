"""No client input creates `/metrics` series: the HTTP families' `method` and `handler` labels
come from fixed sets (the methods HTTP defines and the app's own routes), and any other method or
path folds into `other` (issue 42, finding 8). A method too long for the head limit never reaches them (431)."""

from __future__ import annotations

import asyncio
import random
import string

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_util import serving

KEY = "sk-labels"
HTTP_FAMILIES = ("stallfree:http_requests_total", "stallfree:http_request_duration_seconds")


def _series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _http_labels(text: str, label: str) -> set[str]:
    return {
        s.labels[label]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(HTTP_FAMILIES) and label in s.labels
    }


async def _raw_request(port: int, method: bytes, path: bytes, key: bool) -> bytes:
    """One request sent by hand (a method httpx would not send), the answer's status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = f"Authorization: Bearer {KEY}\r\n".encode() if key else b""
    try:
        head = method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n" + auth
        writer.write(head + b"Content-Length: 0\r\n\r\n")
        await writer.drain()
        return (await reader.readline()).rstrip()
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_random_methods_and_paths_add_no_series(llama: str) -> None:
    rng = random.Random(42)
    letters = string.ascii_uppercase
    async with serving(llama, api_key=KEY) as live:
        port = live.server.port

        async def scrape() -> str:
            return (await live.http.get("/metrics")).text

        def made_up(i: int) -> tuple[bytes, bytes, bool]:
            # 12 KB methods reach the app; 60 KB ones are past the head limit (431)
            size = {0: 12_000, 15: 60_000}.get(i % 30) or rng.randint(1, 40)
            method = "".join(rng.choice(letters) for _ in range(size))
            path = "/" + "".join(rng.choice(string.ascii_lowercase + "/") for _ in range(20))
            if i % 4 == 0:
                path = f"/v1/models{path}/"  # under a templated route
            elif i % 4 == 1:
                path = f"/v1/completions{path}"
            elif i % 4 == 2:
                path = "/tokenize/"  # one slash away from a route: labelled with the path
            return method.encode(), path.encode(), i % 5 == 4  # some with the key

        # every kind of request the test makes seen once, so the baseline holds its series
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"):
            await live.http.request(method, "/v1/models")
            await live.http.request(method, "/no/such/path")
        for i in range(20):  # each path shape with and without the key
            await _raw_request(port, *made_up(i))
        before = await scrape()
        statuses: list[bytes] = []
        for i in range(300):
            statuses.append(await _raw_request(port, *made_up(i)))
        # without the key a 401; with it a 404, a 405 or a redirect to the route; a head over
        # 16 KB a 431; never a 5xx
        codes = {s.split(b" ")[1] for s in statuses}
        assert codes == {b"307", b"401", b"404", b"405", b"431"}, codes
        after = await scrape()

    # only values change, never the set of series
    new = _series(after) - _series(before)
    assert not new, sorted(new)[:10]
    assert len(after) < len(before) + 2_000, (len(before), len(after))
    methods = _http_labels(after, "method")
    assert methods <= {"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "other"}
    assert "other" in methods
    handlers = _http_labels(after, "handler")
    assert handlers == {"/v1/models", "/v1/models/{model_id:path}", "none"}, handlers
