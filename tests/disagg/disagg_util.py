"""Two engines in one process joined by the loopback transport: a prefill side and a decode
side, as `disagg.prefill.PrefillSide` and `disagg.decode.DecodeSide` run them in servers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from stallfree import Engine, SamplingParams
from stallfree.disagg.bootstrap import LocalControl
from stallfree.disagg.decode import DecodeSide
from stallfree.disagg.prefill import PrefillSide
from tests.engine_util import engine_config

LOCAL = "local:0"


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    p: PrefillSide
    d: DecodeSide
    control: LocalControl

    async def run(
        self, ids: list[int], params: SamplingParams, room: int, rid: str | None = None
    ) -> tuple[list[int], str | None]:
        """One request through both sides, as the router runs it: both legs at once."""
        import asyncio

        rid = rid or f"r{room}"

        async def prefill_leg() -> Any:
            return await self.p.prefill(ids, params, rid, room)

        async def decode_leg() -> tuple[list[int], str | None]:
            out: list[int] = []
            reason = None
            async for chunk in self.d.generate(ids, params, rid, room, "local", 0):
                out.extend(chunk.token_ids)
                reason = chunk.finish_reason
            return out, reason

        first, (tokens, reason) = await asyncio.gather(prefill_leg(), decode_leg())
        assert first.token_ids == tokens[:1]
        return tokens, reason


@contextlib.asynccontextmanager
async def engine_pair(
    model: str,
    prefill_sections: dict[str, Any] | None = None,
    decode_sections: dict[str, Any] | None = None,
    **shared: Any,
) -> AsyncIterator[Pair]:
    def config(role: str, extra: dict[str, Any] | None) -> Any:
        sections: dict[str, Any] = {k: dict(v) for k, v in shared.items()}
        for key, values in (extra or {}).items():
            sections.setdefault(key, {}).update(values)
        sections.setdefault("disaggregation", {}).update(mode=role, transfer_backend="loopback")
        return engine_config(model, **sections)

    # the decode side trusts the in-process prefill, named "local" port 0
    decode_sections = {**(decode_sections or {})}
    decode_sections.setdefault("disaggregation", {}).setdefault("prefill_hosts", [LOCAL])
    pcfg, dcfg = config("prefill", prefill_sections), config("decode", decode_sections)
    async with Engine(pcfg) as prefill, Engine(dcfg) as decode:
        p = PrefillSide(prefill, pcfg.disaggregation, pcfg.faults, backend="loopback")
        control = LocalControl(p)
        d = DecodeSide(decode, dcfg.disaggregation, controls=lambda host, port: control)
        await p.start()
        await d.start()
        try:
            yield Pair(prefill, decode, p, d, control)
        finally:
            await d.close()
            await p.close()
