"""What the prefill's bootstrap endpoint lets in: the shared secret (`disaggregation.secret`),
checked on every call but `/health` before anything else is read, and a body limit
(`disaggregation.bootstrap_max_body_bytes`) on the declared length, before the body is read,
so no peer makes the prefill hold more than that in memory for one call.

The secret travels in the `X-Stallfree-Disagg-Secret` header and is compared in constant time.
It is not encrypted: a deployment that crosses an untrusted network puts the bootstrap endpoint
behind TLS (a proxy) or on a private network (docs/disaggregation.md).
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from stallfree.disagg.trust import is_loopback

logger = logging.getLogger(__name__)

SECRET_HEADER = "X-Stallfree-Disagg-Secret"
OPEN_PATHS = ("/health",)


def secret_headers(secret: str | None) -> dict[str, str]:
    """The headers a decode side sends with each call."""
    return {SECRET_HEADER: secret} if secret else {}


def secret_matches(given: str | None, secret: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())


def warn_if_open(host: str, secret: str | None) -> bool:
    """Log a warning when the endpoint binds beyond loopback without a secret (True then)."""
    if secret or is_loopback(host):
        return False
    logger.warning(
        "the prefill bootstrap endpoint binds %s without disaggregation.secret: anyone who "
        "reaches it can pair with this server and register rooms; set a shared secret "
        "(STALLFREE_DISAGGREGATION__SECRET or --disagg-secret) on both sides",
        host,
    )
    return True


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BootstrapGuard:
    """ASGI middleware: a 401 without the secret, a 413 for a body over the limit (411 for a
    body of no declared length)."""

    def __init__(self, app: Any, secret: str | None, max_body_bytes: int) -> None:
        self.app, self.secret, self.max_body_bytes = app, secret, max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.secret and scope.get("path") not in OPEN_PATHS:
            given = headers.get(SECRET_HEADER.lower().encode())
            if not secret_matches(given.decode("latin-1") if given else None, self.secret):
                await _refuse(send, 401, f"the bootstrap endpoint needs {SECRET_HEADER}")
                return
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is None and scope.get("method") not in ("GET", "HEAD"):
            # NOTE: h11 reads no more than a declared length, so a declared length bounds it
            await _refuse(send, 411, "a bootstrap call with a body declares its Content-Length")
            return
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _refuse(send, 413, f"a bootstrap call's body is at most {limit} bytes")
            return
        await self.app(scope, receive, send)
