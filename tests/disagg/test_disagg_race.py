"""Issue 42, finding 2: the KV of a room can arrive (and the room be done) before the reply to
its registration is heard; the request is decoded, not failed."""

from __future__ import annotations

import asyncio

import pytest

from tests.disagg.disagg_util import engine_pair
from tests.disagg.test_disagg_faults import FAST, PARAMS, PROMPT, _until, all_free, still_serves


async def test_kv_that_arrives_before_the_registration_reply_is_decoded(
    llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with engine_pair(llama, **FAST) as pair:
        register = pair.control.register

        async def reply_after_the_kv(room: int, pair_id: str, pages: list[int], n: int) -> None:
            await register(room, pair_id, pages, n)
            # the KV has the room done (it leaves the table) before this reply is heard
            await _until(lambda: pair.d.rooms.get(room) is None)

        monkeypatch.setattr(pair.control, "register", reply_after_the_kv)
        tokens, reason = await asyncio.wait_for(pair.run(PROMPT, PARAMS, 5), 10)
        assert len(tokens) == 6 and reason == "length"
        assert pair.d.stats.failures["transfer"] == 0
        monkeypatch.undo()
        await still_serves(pair, 6)
        await all_free(pair)
