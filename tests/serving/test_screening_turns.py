"""The screening process has a deadline and clients take turns at it (issue 42, finding 13):
a stopped process costs the body in it a 503 and is replaced, and one client's flood of dense
bodies does not hold back another client's one."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx

from stallfree.entrypoints.server.intake import screening
from tests.http_util import MODEL, serving
from tests.process_util import running

# 120k empty messages: 4 MB, dense, refused by the screen (too_many_messages)
DENSE = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 120_000}


def _screener() -> int:
    pool = screening._pool
    assert pool is not None
    (pid,) = list(pool._processes)
    return pid


async def _until(check: Any, tries: int = 2000) -> None:
    for _ in range(tries):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


async def test_a_stopped_screening_process_is_a_503_and_a_new_one_serves_the_next_body():
    async with serving(server={"screening_timeout_s": 2.0}) as live:
        first = await live.http.post("/v1/chat/completions", json=DENSE)
        assert first.json()["error"]["code"] == "too_many_messages"
        stopped = _screener()
        timeouts = screening.screening_queue().timeouts
        os.kill(stopped, signal.SIGSTOP)
        try:
            stuck, after = await asyncio.gather(
                live.http.post("/v1/chat/completions", json=DENSE, timeout=60),
                live.http.post("/v1/chat/completions", json=DENSE, timeout=60),
            )
        finally:
            if running(stopped):
                os.kill(stopped, signal.SIGCONT)
        assert stuck.status_code == 503, stuck.text
        error = stuck.json()["error"]
        assert error["code"] == "screening_timeout" and "screening_timeout_s" in error["message"]
        assert stuck.headers["retry-after"] == "1"
        # the body queued behind it went to a new process
        assert after.status_code == 400 and after.json()["error"]["code"] == "too_many_messages"
        assert screening.screening_queue().timeouts == timeouts + 1
        await _until(lambda: not running(stopped))
        assert _screener() != stopped
        await _until(lambda: live.server.server.sf.lifecycle.in_flight == 0)
        plain = await live.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        assert plain.status_code == 200


async def test_one_clients_flood_does_not_hold_back_another_clients_body():
    async with serving(server={"api_key": ["flood", "other"]}) as live:

        async def post(key: str) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            return await live.http.post(
                "/v1/chat/completions", json=DENSE, headers=headers, timeout=120
            )

        assert (await post("flood")).status_code == 400  # the process is up
        order: list[str] = []

        def sent(key: str) -> asyncio.Task[httpx.Response]:
            task = asyncio.create_task(post(key))
            task.add_done_callback(lambda _: order.append(key))
            return task

        queue = screening.screening_queue()
        flood = [sent("flood") for _ in range(10)]
        await _until(lambda: queue.waiting() >= 6)
        other = sent("other")
        answers = await asyncio.gather(*flood, other)
        assert all(a.json()["error"]["code"] == "too_many_messages" for a in answers)
        # at most one flood body is taken between the other client's arrival and its turn,
        # so at least four of the six or more that were waiting are answered after it; one
        # queue for all would answer it last
        assert order.count("flood") == 10
        assert len(order) - 1 - order.index("other") >= 4, order
