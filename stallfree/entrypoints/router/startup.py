"""What the router checks before it listens: every server up, every pair able to work together.

First each server must answer `GET /health` with 200 (within `--startup-timeout-s`). Then each
decode server is asked to handshake with each prefill server (`POST {decode}/disagg/connect`
with the prefill's bootstrap host and port): a decode server that cannot take that prefill's
KV (another model, page size, dtype, transfer backend) refuses with an OpenAI-style error
body, and the router does not start, rather than failing every request it would send to the
pair.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from stallfree.entrypoints.router.dispatch import Router
from stallfree.entrypoints.router.pool import Server, describe, probe

PROBE_EVERY_S = 0.25
HANDSHAKE_TIMEOUT_S = 30.0


class StartupError(Exception):
    """The router cannot start; `exit_code` is 1 when servers did not come up or answer, 2
    when a decode server refused a prefill server (a configuration to fix)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


async def wait_until_up(client: httpx.AsyncClient, servers: list[Server], timeout_s: float) -> None:
    """Return once every server answers /health with 200; StartupError naming the ones that
    did not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    last: dict[str, str] = {}
    while True:
        answers = await asyncio.gather(
            *(probe(client, s.url, max(0.1, min(2.0, timeout_s))) for s in waiting)
        )
        last = {s.url: a for s, a in zip(waiting, answers, strict=True) if a is not None}
        waiting = [s for s in waiting if s.url in last]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            names = "; ".join(f"{s.role} {s.url} ({last[s.url]})" for s in waiting)
            raise StartupError(
                f"router: not up after {timeout_s:g}s (GET /health did not answer 200): {names}",
                1,
            )
        await asyncio.sleep(PROBE_EVERY_S)


def error_message(resp: httpx.Response) -> str:
    """The message of an OpenAI-style error body, or the body's start, or the status."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
    text = resp.text.strip()
    return text[:300] if text else f"HTTP {resp.status_code}"


async def handshake(
    client: httpx.AsyncClient, prefill: Server, decode: Server, api_key: str | None
) -> StartupError | None:
    """None when `decode` agrees to work with `prefill`; else the error saying why not."""
    body = {"bootstrap_host": prefill.bootstrap_host, "bootstrap_port": prefill.bootstrap_port}
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.post(
            f"{decode.url}/disagg/connect", json=body, headers=headers, timeout=HANDSHAKE_TIMEOUT_S
        )
    except httpx.HTTPError as exc:
        return StartupError(
            f"router: decode {decode.url} did not answer /disagg/connect: {describe(exc)}", 1
        )
    if resp.status_code == 200:
        return None
    return StartupError(
        f"router: decode {decode.url} cannot work with prefill {prefill.url}: "
        f"{error_message(resp)}",
        2,
    )


async def check_servers(router: Router) -> None:
    """Everything above; StartupError with one line per problem found."""
    pool, settings = router.pool, router.settings
    await wait_until_up(router.client, pool.servers, settings.startup_timeout_s)
    pairs = [(p, d) for d in pool.decode for p in pool.prefill]
    answers = await asyncio.gather(
        *(handshake(router.client, p, d, settings.api_key) for p, d in pairs)
    )
    problems = [err for err in answers if err is not None]
    if problems:
        # a refusal is the configuration to fix (2), even beside a server that did not answer
        code = max(err.exit_code for err in problems)
        raise StartupError("\n".join(str(err) for err in problems), code)
