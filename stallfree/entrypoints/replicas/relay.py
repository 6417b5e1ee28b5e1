"""One request relayed to one replica: the prefill/decode router's relay with a single leg.

The body goes to the replica as the client sent it; the answer comes back as it arrives
(streamed or whole), with the router's handling of failures: a replica that answers an error
passes it on; one whose connection fails or breaks off (its process died) ends the request
with a 502 naming it or, once a stream has started, one SSE error event that closes the
stream; a client that leaves closes the replica's request, which is how a server learns to
abort it.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import Message, Receive, Scope, Send

from stallfree.entrypoints.router.dispatch import (
    CLIENT_CLOSED_REQUEST,
    Plan,
    Relay,
    Router,
    logger,
    stop_task,
    until_disconnect,
)
from stallfree.entrypoints.router.leg_failure import leg_failure
from stallfree.entrypoints.router.pool import Server


class ReplicaRelay(Relay):
    answer_leg = "replica"

    def __init__(self, router: Router, plan: Plan, server: Server) -> None:
        super().__init__(router, plan)
        self.server = server  # counted in flight by the caller, uncounted here when done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        router, server = self.router, self.server
        send = _without_request_id(send)
        call = asyncio.create_task(
            self._decode_leg(server, self.plan.core, self._leg_headers(), send)
        )
        # released when the task ends, however: a task cancelled before it ran has no finally
        call.add_done_callback(lambda _: router.pool.release(server))
        gone = asyncio.create_task(until_disconnect(receive))
        try:
            done, _ = await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
            if call in done:
                failure = leg_failure(call)
                if failure is None:
                    await self._finish(call.result(), send)
                else:
                    await self._fail(failure, send)
            else:
                self.answer_status = CLIENT_CLOSED_REQUEST
                router.metrics.leg_failures.labels(leg="client").inc()
                logger.info("request %s: the client left; its replica's request closed",
                            self.request_id)  # fmt: skip
        finally:
            gone.cancel()
            await stop_task(call)
            elapsed = time.monotonic() - self.plan.started_at
            router.metrics.answered(self.plan.route, self.answer_status, elapsed)


def _without_request_id(send: Send) -> Send:
    """`send` with the relay's x-request-id left off the head: the front's Guard adds the
    same id itself, and an answer carries it once."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", ()) if h[0] != b"x-request-id"]
            message = {**message, "headers": headers}
        await send(message)

    return sending
