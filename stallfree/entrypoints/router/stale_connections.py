"""Sending a leg again when the pooled connection it went out on was already closed.

A server closes a keep-alive connection left idle past its timeout (uvicorn's and vLLM's
default is 5 s; ours keep them 120 s, `server.keep_alive_s`). A request the router sends on such
a connection as the server closes it never reaches the application: the connection ends before
any answer (httpx's RemoteProtocolError "Server disconnected without sending a response", or a
ReadError or WriteError on it). The router keeps idle connections for less than that
(`KEEPALIVE_S`), but a loaded router's loop can see a connection's idle time late; a
1,000-request PD soak on two busy cores, with the servers' keep-alive at 5 s, lost 4 to 7
requests so, each a 502 or a cut stream. So a leg whose request failed that way is sent once
more, on a fresh connection: a connection that failed is never handed out again by httpx's pool.

A server that dies holding the request ends the first try the same way; the second then fails
to connect, and that is the leg's failure.
"""

from __future__ import annotations

import httpx

# what a request sent on a connection the server had closed ends with, before any answer
STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


async def send_fresh_on_stale(
    client: httpx.AsyncClient, request: httpx.Request, stream: bool = False
) -> httpx.Response:
    """`client.send(request)`, once more when it ended as on a closed connection."""
    try:
        return await client.send(request, stream=stream)
    except STALE:
        return await client.send(request, stream=stream)
