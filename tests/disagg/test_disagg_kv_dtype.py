"""Disaggregation with a quantized KV cache: the transfer carries stored rows (an int8 row's
scale rides in its last bytes), the decode side's greedy output equals a colocated engine's
with the same cache, and the handshake refuses a pair whose caches store KV differently."""

from __future__ import annotations

import asyncio

import pytest
import torch

from stallfree import Engine, SamplingParams
from stallfree.disagg.fingerprint import HandshakeError
from stallfree.disagg.transport import (
    LoopbackChannel,
    RoomHeader,
    recv_layer,
    send_layer,
)
from stallfree.runtime.memory.kv_format import kv_format
from tests.disagg.disagg_util import engine_pair
from tests.engine_util import engine_config, random_prompts, run_greedy, settle


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
async def test_quantized_transfer_equals_colocated(llama: str, kv_cache_dtype: str) -> None:
    prompts = random_prompts(6, seed=3)
    cache = {"kv_cache_dtype": kv_cache_dtype, "page_size": 4, "max_total_tokens": 2048}
    async with Engine(engine_config(llama, cache=cache)) as colocated:
        want = await run_greedy(colocated, prompts, 24)
    async with Engine(engine_config(llama, cache={"page_size": 4})) as plain:
        assert await run_greedy(plain, prompts, 24) != want  # the rounding shows
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    async with engine_pair(llama, cache=cache) as pair:
        got = await asyncio.gather(
            *(pair.run(ids, params, room=200 + i) for i, ids in enumerate(prompts))
        )
        assert [tokens for tokens, _ in got] == want
        await settle(pair.prefill)
        await settle(pair.decode)
        assert pair.p.stats.transfers == len(prompts) == pair.d.stats.transfers
        assert pair.decode.snapshot().counters.prefill_tokens == 0  # every row came over
        for engine in (pair.prefill, pair.decode):
            assert engine.pool_usage().all_free


@pytest.mark.parametrize(
    ("prefill", "decode", "named"),
    [
        ("int8", "auto", "KV dtype differs: prefill int8, decode float32"),
        ("fp8_e4m3", "fp8_e5m2", "KV dtype differs: prefill fp8_e4m3, decode fp8_e5m2"),
    ],
)
async def test_handshake_refuses_another_kv_format(
    llama: str, prefill: str, decode: str, named: str
) -> None:
    async with engine_pair(
        llama,
        prefill_sections={"cache": {"kv_cache_dtype": prefill}},
        decode_sections={"cache": {"kv_cache_dtype": decode}},
    ) as pair:
        with pytest.raises(HandshakeError, match=named):
            await pair.d.connect("local", 0)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_layer_crosses_the_channel_bit_for_bit(name: str) -> None:
    """fp8 travels as its bytes (gloo has no float8), int8 as it is; the scales with them."""
    fmt = kv_format(name, torch.float32)
    k = fmt.encode(torch.randn(8, 2, 16) * 5)
    v = fmt.encode(torch.randn(8, 2, 16))
    channel = LoopbackChannel()
    send_layer(channel, [(k, v)])
    header = RoomHeader(1, 8, 1, fmt.row_width(16), fmt.storage, 8, [(1, 1)], [2])
    (k2,), (v2,) = recv_layer(channel, header)
    assert k2.dtype == fmt.storage and k2.shape == (8, 2, fmt.row_width(16))
    assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(fmt.decode(v2), fmt.decode(v))
