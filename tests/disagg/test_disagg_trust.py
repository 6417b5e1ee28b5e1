"""Whom a decode server talks to, and what a peer can make it do (issue 42, findings 1 and 3):
only the prefill servers it was told to trust, named by a request or not (403 naming
`bootstrap_host`, nothing contacted); no receive is posted with a size the receiver did not
check (a header that disagrees fails the pair, never the process); a peer's answer never
reaches the client."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import torch

from stallfree import Engine
from stallfree.disagg.rooms import RoomError, RoomState
from stallfree.disagg.transport import DTYPES, HEADER_LEN, MAGIC_HEADER, LoopbackChannel
from stallfree.disagg.trust import PrefillAllowList, UntrustedPrefillError
from stallfree.entrypoints.server import create_app, start_server
from tests.disagg.disagg_util import Pair, engine_pair
from tests.disagg.test_disagg_faults import (
    PARAMS,
    PROMPT,
    _decode_only,
    _state,
    _until,
    all_free,
    still_serves,
)
from tests.engine_util import engine_config, settle

MODEL = "test-model"

# ---------------------------------------------------------------------- the allow-list


def test_unset_allow_list_trusts_loopback_only() -> None:
    trusted = PrefillAllowList([])
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert trusted.allows(host, 8998), host
    for host in ("10.0.0.1", "0.0.0.0", "169.254.169.254", "127.0.0.1.evil.example", "::"):
        assert not trusted.allows(host, 8998), host


def test_allow_list_is_exact_host_and_port() -> None:
    trusted = PrefillAllowList(["10.0.0.5:8998", "[fd00::1]:9000", "Prefill-A:8998"])
    assert trusted.allows("10.0.0.5", 8998)
    assert trusted.allows("fd00:0::1", 9000) and trusted.allows("prefill-a", 8998)
    assert not trusted.allows("10.0.0.5", 8999)
    assert not trusted.allows("127.0.0.1", 8998)  # a list given: loopback is not implied
    with pytest.raises(UntrustedPrefillError, match=r"bootstrap_host '10\.0\.0\.6'"):
        trusted.check("10.0.0.6", 8998)


def test_prefill_hosts_flag_and_setting() -> None:
    from stallfree.config import DisaggregationConfig
    from stallfree.entrypoints.disagg_flags import DISAGGREGATION_FLAGS, disaggregation_settings
    from stallfree.entrypoints.flags import add_flags

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, DISAGGREGATION_FLAGS)
    args = parser.parse_args(["--disagg-prefill-hosts", "10.0.0.5:8998, [::1]:9000"])
    settings = disaggregation_settings(args)
    assert settings == {"prefill_hosts": ["10.0.0.5:8998", "[::1]:9000"]}
    assert DisaggregationConfig(**settings).prefill_hosts == settings["prefill_hosts"]
    with pytest.raises(ValueError, match="host:port"):
        DisaggregationConfig(prefill_hosts=["10.0.0.5"])


async def test_decode_side_never_contacts_an_untrusted_prefill(llama: str) -> None:
    async with engine_pair(llama) as pair:
        made: list[tuple[str, int]] = []
        pair.d._controls = lambda host, port: made.append((host, port)) or pair.control  # type: ignore[func-returns-value]
        with pytest.raises(UntrustedPrefillError, match="bootstrap_host"):
            await pair.d.connect("10.0.0.9", 8998)
        gen = pair.d.generate(PROMPT, PARAMS, "d1", 1, "10.0.0.9", 8998)
        with pytest.raises(UntrustedPrefillError):
            await gen.__anext__()
        assert made == [] and len(pair.d.rooms) == 0
        await still_serves(pair, 2)
        await all_free(pair)


# ---------------------------------------------------------------------- the receiver


def _head(pair: Pair, room: int, **change: int) -> list[int]:
    """A header's first message as the prefill would send it for `room`, with `change`."""
    layout = pair.d.layout()
    fields = {
        "num_tokens": len(PROMPT),
        "num_layers": layout.num_layers,
        "head_dim": layout.head_dim,
        "dtype": DTYPES.index(layout.dtype),
        "page_size": layout.page_size,
        "runs": 1,
        "shards": len(layout.shard_heads),
    } | change
    head = [MAGIC_HEADER, room, *fields.values()]
    return head + [0] * (HEADER_LEN - len(head))


@pytest.mark.parametrize(
    "change,runs,named",
    [
        pytest.param({"head_dim": 1 << 20}, None, "head dim 1048576", id="head-dim"),
        pytest.param({"dtype": 3}, None, "dtype torch.float64", id="dtype"),
        pytest.param({"num_layers": 1 << 30}, None, "layers 1073741824", id="layers"),
        pytest.param({"runs": 1 << 40}, None, "1099511627776 page runs", id="runs"),
        pytest.param({"shards": 1 << 30}, None, "KV-head shards 1073741824", id="shards"),
        pytest.param({}, [[1, 1 << 40]], "page runs outside pages", id="run-range"),
    ],
)
async def test_a_header_that_disagrees_fails_its_pair_before_any_receive_of_its_size(
    llama: str,
    change: dict[str, int],
    runs: list[list[int]] | None,
    named: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = {"disaggregation": {"transfer_timeout_s": 30.0, "bootstrap_timeout_s": 1.0}}
    posted: list[tuple[int, ...]] = []
    recv = LoopbackChannel.recv

    def recording_recv(self: LoopbackChannel, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        posted.append(tuple(shape))
        return recv(self, shape, dtype)

    monkeypatch.setattr(LoopbackChannel, "recv", recording_recv)
    async with engine_pair(llama, **slow) as pair:
        await pair.run(PROMPT, PARAMS, 1)  # paired
        (prefill_end,) = pair.p.pairs.values()
        channel = prefill_end.channel
        assert channel is not None
        task = asyncio.ensure_future(_decode_only(pair, 2))
        await _until(lambda: _state(pair, 2) is RoomState.TRANSFERRING)
        mark = len(posted)
        # a hostile prefill: a header whose sizes are not the handshake's
        channel.send(torch.tensor(_head(pair, 2, **change), dtype=torch.int64))
        if runs is not None:
            channel.send(torch.tensor(runs, dtype=torch.int64))
        with pytest.raises(RoomError, match=f"prefill lost: .*{named}"):
            await asyncio.wait_for(task, 5)
        # NOTE: the header's fixed-size first receive may be posted before `mark` (the receiver
        # waits in it): past it, only the run list, and only when its count was agreed
        after = [shape for shape in posted[mark:] if shape != (HEADER_LEN,)]
        assert after == ([(len(runs), 2)] if runs is not None else []), after
        await still_serves(pair, 3)  # the next request pairs anew
        await all_free(pair)


# ---------------------------------------------------------------------- over HTTP


class FakePrefill:
    """A listener on loopback that counts connections and answers each with a 500 whose body
    holds a marker (what a probed service's banner would be)."""

    BODY = b"SECRET-BANNER of an internal service"

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(self.BODY), self.BODY)
            )
            await writer.drain()
        writer.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@contextlib.asynccontextmanager
async def decode_server(llama: str, prefill_hosts: list[str], **disagg: Any) -> AsyncIterator[Any]:
    cfg = engine_config(
        llama,
        server={"served_model_name": MODEL},
        disaggregation={"mode": "decode", "prefill_hosts": prefill_hosts, **disagg},
    )
    engine = Engine(cfg)
    server = await start_server(create_app(engine))
    client = httpx.AsyncClient(base_url=server.url, timeout=30)
    try:
        yield engine, client
    finally:
        await client.aclose()
        await server.stop()
        await engine.shutdown()


def _body(host: str, port: int, room: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": 4,
        "bootstrap_host": host,
        "bootstrap_port": port,
        "bootstrap_room": room,
    }


async def test_decode_server_refuses_unlisted_prefills(
    llama: str,
) -> None:
    listed, unlisted = FakePrefill(), FakePrefill()
    async with listed as listed_port, unlisted as unlisted_port:
        hosts = [f"127.0.0.1:{listed_port}"]
        async with decode_server(llama, hosts) as (engine, client):
            # not listed: a 403 naming the field, and nothing is contacted
            for host, port in (("10.255.255.1", 8998), ("127.0.0.1", unlisted_port)):
                r = await client.post("/v1/completions", json=_body(host, port, 7))
                assert r.status_code == 403, r.text
                error = r.json()["error"]
                assert error["param"] == "bootstrap_host" and "bootstrap_host" in error["message"]
                r = await client.post(
                    "/disagg/connect", json={"bootstrap_host": host, "bootstrap_port": port}
                )
                assert r.status_code == 403 and "bootstrap_host" in r.text, r.text
            assert unlisted.connections == 0
            assert (await client.get("/health")).status_code == 200  # still serving
            await settle(engine)


async def test_a_listed_prefills_answer_never_reaches_the_client(llama: str) -> None:
    listed = FakePrefill()
    async with listed as port, decode_server(llama, [f"127.0.0.1:{port}"]) as (engine, client):
        r = await client.post("/v1/completions", json=_body("127.0.0.1", port, 8))
        assert listed.connections >= 1
        # the client learns the status, never the body
        assert r.status_code == 503 and "answered HTTP 500" in r.text, r.text
        assert "SECRET" not in r.text
        r = await client.post(
            "/disagg/connect", json={"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        )
        assert r.status_code == 502 and "answered HTTP 500" in r.text, r.text
        assert "SECRET" not in r.text
        assert (await client.get("/health")).status_code == 200  # still serving
        await settle(engine)


def test_secret_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from stallfree.config import DisaggregationConfig, load_config
    from stallfree.entrypoints.disagg_flags import DISAGGREGATION_FLAGS, disaggregation_settings
    from stallfree.entrypoints.flags import add_flags

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, DISAGGREGATION_FLAGS)
    args = parser.parse_args(["--disagg-secret", "s" * 16, "--disagg-pair-timeout", "3"])
    assert disaggregation_settings(args) == {"secret": "s" * 16, "pair_timeout_s": 3.0}
    with pytest.raises(ValueError, match="at least 16"):
        DisaggregationConfig(secret="short")
    monkeypatch.setenv("STALLFREE_DISAGGREGATION__SECRET", "e" * 20)
    assert load_config().disaggregation.secret == "e" * 20


async def test_server_info_never_shows_the_secret(llama: str) -> None:
    secret = "the-secret-of-this-deployment"
    async with decode_server(llama, [], secret=secret) as (engine, client):
        info = await client.get("/server_info")
        assert info.status_code == 200
        assert info.json()["config"]["disaggregation"]["secret"] == "<redacted>"
        assert secret not in info.text
        await settle(engine)
