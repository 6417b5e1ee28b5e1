"""Disaggregation's failures between two engines in one process: injected transfer faults
(dropped, late, wrong room), a prefill that dies, clients that leave in each state, and a
handshake between servers that cannot work together. Each ends with a clear error or a whole
answer, the next request is served, and both pools are all free."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from stallfree import SamplingParams
from stallfree.disagg.fingerprint import HandshakeError
from stallfree.disagg.rooms import RoomError, RoomState
from stallfree.overlap.faults import TransferFaults
from tests.disagg.disagg_util import LOCAL, Pair, engine_pair
from tests.engine_util import settle

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPT = [5, 9, 2, 7, 7, 1, 3, 8, 4, 4, 6]
FAST = {"disaggregation": {"transfer_timeout_s": 0.6, "bootstrap_timeout_s": 2.0}}
# liveness: a room whose lost prefill is not noticed this long after is a failure (the transfer
# deadline of the test that uses it is 30 s)
LOST_TIMEOUT_S = 10.0


def faulty(**rates: Any) -> dict[str, Any]:
    return {"faults": {"enabled": True, **rates}}


async def all_free(pair: Pair) -> None:
    for _ in range(100):  # the prefill side frees on its ack or its deadline
        if not len(pair.p.rooms) and not len(pair.d.rooms):
            break
        await asyncio.sleep(0.02)
    await settle(pair.prefill)
    await settle(pair.decode)
    assert not pair.prefill.core.scheduler.deferred.held
    assert not pair.decode.core.scheduler.queues.imports


async def still_serves(pair: Pair, room: int) -> None:
    pair.p.faults = None
    tokens, reason = await asyncio.wait_for(pair.run(PROMPT, PARAMS, room), 10)
    assert len(tokens) == 6 and reason == "length"


async def legs(pair: Pair, room: int) -> tuple[Any, Any]:
    async def decode() -> list[int]:
        out: list[int] = []
        async for chunk in pair.d.generate(PROMPT, PARAMS, f"d{room}", room, "local", 0):
            out.extend(chunk.token_ids)
        return out

    return tuple(
        await asyncio.wait_for(
            asyncio.gather(
                pair.p.prefill(PROMPT, PARAMS, f"p{room}", room), decode(), return_exceptions=True
            ),
            10,
        )
    )


@pytest.mark.parametrize(
    "rates,decode_stage",
    [
        pytest.param({"kv_drop_rate": 1.0}, "transfer", id="dropped"),
        pytest.param({"kv_wrong_room_rate": 1.0}, "transfer", id="wrong-room"),
        pytest.param({"kv_delay_rate": 1.0, "kv_delay_seconds": 1.2}, "transfer", id="late"),
    ],
)
async def test_transfer_faults_fail_both_legs_then_serve(
    llama: str, rates: dict[str, Any], decode_stage: str
) -> None:
    async with engine_pair(llama, prefill_sections=faulty(**rates), **FAST) as pair:
        p_out, d_out = await legs(pair, 11)
        assert isinstance(d_out, RoomError) and d_out.stage == decode_stage, d_out
        assert "deadline" in str(d_out)
        assert isinstance(p_out, RoomError), p_out
        if "kv_delay_rate" in rates:
            await asyncio.sleep(1.0)  # the late transfer arrives, for a room that is gone
        if "kv_drop_rate" not in rates:
            assert pair.d.wrong_rooms == 1  # read and dropped: the channel stays in step
        assert pair.d.stats.failures["transfer"] >= 1
        await still_serves(pair, 12)
        await all_free(pair)


async def test_prefill_lost_fails_its_rooms_before_their_deadline(llama: str) -> None:
    slow = {"disaggregation": {"transfer_timeout_s": 30.0}}
    async with engine_pair(llama, **slow) as pair:
        await pair.run(PROMPT, PARAMS, 1)  # paired
        task = asyncio.ensure_future(_decode_only(pair, 2))
        await _until(lambda: _state(pair, 2) is RoomState.TRANSFERRING)
        pair.control.alive = False
        for p in list(pair.p.pairs.values()):  # the prefill process is gone: its channel too
            assert p.channel is not None
            p.channel.close()
        # the liveness bound is far inside the 30 s transfer deadline: what failed the room was
        # the lost prefill, not its deadline
        with pytest.raises(RoomError, match="prefill lost"):
            await asyncio.wait_for(task, LOST_TIMEOUT_S)
        pair.control.alive = True
        await still_serves(pair, 3)  # the next request pairs anew
        await all_free(pair)


async def _decode_only(pair: Pair, room: int) -> list[int]:
    out: list[int] = []
    async for chunk in pair.d.generate(PROMPT, PARAMS, f"d{room}", room, "local", 0):
        out.extend(chunk.token_ids)
    return out


def _state(pair: Pair, room: int) -> RoomState | None:
    r = pair.d.rooms.get(room)
    return r.state if r is not None else None


async def _until(cond: Any, timeout: float = 5) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


async def test_decode_client_leaves_while_transferring(llama: str) -> None:
    async with engine_pair(llama, **FAST) as pair:
        task = asyncio.ensure_future(_decode_only(pair, 21))  # no prefill leg yet
        await _until(lambda: _state(pair, 21) is RoomState.TRANSFERRING)
        assert pair.decode.pool_usage().req_slots_free < pair.decode.pool_usage().req_slots_total
        # admission counts it as running, with its outputs reserved; no batch holds it
        scheduler = pair.decode.core.scheduler
        assert scheduler.prefill.new_adder().running == 1
        assert scheduler.prefill.reserved_tokens() > 0  # its outputs, scaled by new_token_ratio
        assert not scheduler.queues.running_batch.reqs
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # the prefill side hears of it: the room it opened for the registration fails
        await _until(lambda: pair.p.rooms.get(21) is None)
        await still_serves(pair, 22)
        await all_free(pair)


async def test_prefill_client_leaves_while_waiting_for_decode(llama: str) -> None:
    async with engine_pair(llama, **FAST) as pair:
        task = asyncio.ensure_future(pair.p.prefill(PROMPT, PARAMS, "p31", 31))
        # prefilled and held, waiting for the decode side's pages
        await _until(lambda: bool(pair.prefill.core.scheduler.deferred.held))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _until(lambda: not pair.prefill.core.scheduler.deferred.held)
        await still_serves(pair, 32)
        await all_free(pair)


async def test_no_decode_registration_frees_prefill_at_its_deadline(llama: str) -> None:
    fast = {"disaggregation": {"bootstrap_timeout_s": 0.5}}
    async with engine_pair(llama, **fast) as pair:
        with pytest.raises(RoomError, match="deadline"):
            await asyncio.wait_for(pair.p.prefill(PROMPT, PARAMS, "p41", 41), 5)
        assert pair.p.stats.failures["bootstrap"] == 1
        await all_free(pair)


async def test_decode_client_leaves_mid_decode(llama: str) -> None:
    long = SamplingParams(max_new_tokens=400, ignore_eos=True)
    async with engine_pair(llama, **FAST) as pair:
        prefill = asyncio.ensure_future(pair.p.prefill(PROMPT, long, "p51", 51))
        gen = pair.d.generate(PROMPT, long, "d51", 51, "local", 0)
        got = [await gen.__anext__() for _ in range(3)]
        assert all(c.token_ids for c in got)
        await gen.aclose()
        await prefill  # acknowledged before decoding began
        await all_free(pair)


@pytest.mark.parametrize(
    "decode_sections,named",
    [
        pytest.param(
            {"cache": {"page_size": 4}}, "page size differs: prefill 1, decode 4", id="page"
        ),
        pytest.param({"model": {"dtype": "float64"}}, "KV dtype differs", id="dtype"),
    ],
)
async def test_handshake_refuses_a_mismatch(
    llama: str, decode_sections: dict[str, Any], named: str
) -> None:
    async with engine_pair(llama, decode_sections=decode_sections) as pair:
        with pytest.raises(HandshakeError, match=named):
            await pair.d.connect("local", 0)
        with pytest.raises(HandshakeError, match=named):
            await _decode_only(pair, 61)
        await all_free(pair)


async def test_handshake_refuses_another_model(llama: str, tmp_path: Any) -> None:
    from tests.hf_models import make_llama

    other = str(make_llama(tmp_path, seed=7))
    async with engine_pair(llama) as pair:
        from stallfree import Engine
        from stallfree.disagg.decode import DecodeSide
        from tests.engine_util import engine_config

        cfg = engine_config(other, disaggregation={"mode": "decode", "prefill_hosts": [LOCAL]})
        async with Engine(cfg) as engine:
            side = DecodeSide(engine, cfg.disaggregation, controls=lambda h, p: pair.control)
            await side.start()
            try:
                with pytest.raises(HandshakeError, match="model weights"):
                    await side.connect("local", 0)
            finally:
                await side.close()


def test_fault_schedule_is_seeded() -> None:
    from stallfree.config import FaultConfig

    cfg = FaultConfig(enabled=True, seed=3, kv_drop_rate=0.3, kv_wrong_room_rate=0.3)
    a, b = TransferFaults(cfg), TransferFaults(cfg)
    plan = [a.plan() for _ in range(50)]
    assert plan == [b.plan() for _ in range(50)]
    assert {f.value for f in plan} == {"none", "drop", "wrong_room"}


async def test_an_ack_that_overtakes_the_senders_report_completes_the_room(llama: str) -> None:
    async with engine_pair(llama) as pair:
        room = pair.p._room(999)
        room.advance(RoomState.TRANSFERRING)  # the sender thread's "sent" not yet heard
        assert pair.p.ack(999, True)
        assert room.state is RoomState.DONE and pair.p.rooms.get(999) is None


async def test_pairing_is_bounded(llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from stallfree.disagg import prefill

    monkeypatch.setattr(prefill, "MAX_PAIRS", 1)
    async with engine_pair(llama) as pair:
        await pair.d.connect("local", 0)
        with pytest.raises(HandshakeError, match="at most 1"):
            pair.p.pair(pair.d.fingerprint, pair.d.shards())
