"""A prefill's bootstrap endpoint keeps a decode server's idle connection longer than the
decode server's httpx pool keeps it (5 s; issue 42): at uvicorn's default 5 s, a registration
or an acknowledgement sent on a pooled connection just as the endpoint closed it was lost, and
its room failed. A connection idle past 5 s is still answered."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from tests.disagg.test_disagg_bootstrap_limits import bootstrap
from tests.http_util import get_on

# httpx's default keepalive_expiry: how long the decode server's pool keeps an idle connection
HTTPX_KEEPALIVE_S = 5.0
LIVENESS_S = 30.0


async def test_a_connection_idle_past_a_clients_pool_expiry_is_still_answered(llama: str) -> None:
    async with bootstrap(llama) as (_, client):
        url = urlsplit(str(client.base_url))
        assert url.hostname is not None and url.port is not None
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            assert await get_on(reader, writer, "/health", LIVENESS_S) == 200
            await asyncio.sleep(HTTPX_KEEPALIVE_S + 1.0)
            assert await get_on(reader, writer, "/health", LIVENESS_S) == 200
        finally:
            writer.close()
