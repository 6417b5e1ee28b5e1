"""PrefillAdder on its own: budgets, caps and the named outcomes, with no batch and no stream."""

from __future__ import annotations

import math

import pytest

from stallfree.runtime.memory.pool import TokenToKVPoolAllocator
from stallfree.runtime.request.req import Req
from stallfree.runtime.request.sampling_params import SamplingParams
from stallfree.runtime.scheduling.admission import Admit, PrefillAdder, reserved_tokens


def _req(rid: str, prompt_len: int, max_new_tokens: int = 8) -> Req:
    return Req(
        rid=rid,
        origin_input_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
    )


def _adder(
    kv_tokens: int = 256,
    page_size: int = 4,
    budget: int = 1024,
    free_tokens: int | None = None,
    free_slots: int = 8,
    running: int = 0,
    max_running: int = 8,
    chunk_size: int = 64,
    ratio: float = 1.0,
) -> PrefillAdder:
    allocator = TokenToKVPoolAllocator(kv_tokens, page_size)
    return PrefillAdder(
        allocator=allocator,
        budget=budget,
        free_tokens=allocator.available_size() if free_tokens is None else free_tokens,
        free_slots=free_slots,
        running=running,
        max_running=max_running,
        chunk_size=chunk_size,
        new_token_ratio=ratio,
    )


def test_a_request_that_fits_is_added_whole_and_charged_its_pages_and_reservation():
    adder = _adder()
    req = _req("a", 10, max_new_tokens=6)
    assert adder.try_add(req) is Admit.ADDED
    assert adder.reqs == [req] and adder.extend_lens == [10]
    assert adder.budget == 1024 - 10
    # three pages of 4 for the prompt, and its 6 outputs reserved at ratio 1
    assert adder.free_tokens == 256 - (12 + 6)
    assert adder.free_slots == 7


def test_the_reservation_scales_with_new_token_ratio():
    adder = _adder(ratio=0.5)
    adder.try_add(_req("a", 8, max_new_tokens=9))
    assert adder.free_tokens == 256 - (8 + math.ceil(9 * 0.5))


def test_a_prompt_longer_than_the_chunk_is_chunked():
    adder = _adder(chunk_size=16)
    req = _req("long", 40)
    assert adder.try_add(req) is Admit.CHUNKED
    assert adder.extend_lens == [16]


def test_the_budget_caps_the_chunk_and_an_empty_budget_leaves_no_room():
    adder = _adder(budget=12)
    assert adder.try_add(_req("a", 20)) is Admit.CHUNKED
    assert adder.extend_lens == [12] and adder.budget == 0
    assert not adder.has_room()


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"running": 3, "max_running": 4}, "the request cap"),
        ({"free_slots": 1}, "the request slots"),
    ],
)
def test_has_room_counts_the_running_requests_and_the_slots(kw, why):
    adder = _adder(**kw)
    assert adder.has_room(), why
    assert adder.try_add(_req("a", 4)) is Admit.ADDED
    assert not adder.has_room(), why


def test_no_room_when_the_cost_exceeds_what_is_free_and_others_are_running():
    adder = _adder(free_tokens=20, running=1)
    req = _req("a", 16, max_new_tokens=16)  # 16 + 16 reserved > 20
    assert adder.try_add(req) is Admit.NO_ROOM
    assert adder.reqs == [] and adder.free_tokens == 20 and adder.free_slots == 8


def test_alone_it_starts_on_the_pages_that_are_free_now():
    """With nothing running, a request whose reservation does not fit still starts when its
    chunk's pages are there: it grows by retraction later."""
    adder = _adder(kv_tokens=64, free_tokens=24)
    req = _req("a", 16, max_new_tokens=40)  # 16 + 40 reserved > 24, but 4 pages are free
    assert adder.try_add(req) is Admit.ADDED


def test_a_request_bigger_than_the_whole_cache_never_fits():
    adder = _adder(kv_tokens=32, page_size=4)
    huge = _req("huge", 40)  # 41 tokens need 11 pages of 4; the cache has 8
    assert adder.never_fits(huge)
    assert adder.try_add(huge) is Admit.NEVER_FITS
    assert adder.reqs == []


def test_locked_cached_pages_are_no_longer_free_and_cached_tokens_are_not_recomputed():
    adder = _adder(page_size=4)
    req = _req("a", 20, max_new_tokens=4)
    assert adder.try_add(req, cached_tokens=8, locked_tokens=8) is Admit.ADDED
    assert adder.extend_lens == [12]  # 20 - 8 cached
    assert adder.free_tokens == 256 - 8 - (12 + 4)


def test_add_chunked_continues_the_chunked_request_without_a_new_slot():
    adder = _adder(chunk_size=16, page_size=4)
    req = _req("long", 40)
    req.num_computed_tokens = 32
    req.kv_pages = list(range(1, 9))  # 32 tokens held already
    assert adder.add_chunked(req) is Admit.ADDED  # the last 8 tokens
    assert adder.extend_lens == [8] and adder.free_slots == 8
    assert adder.free_tokens == 256 - 8  # two new pages


def test_add_chunked_says_chunked_while_the_prompt_goes_on_and_no_room_without_pages():
    adder = _adder(chunk_size=16, page_size=4)
    req = _req("long", 64)
    assert adder.add_chunked(req) is Admit.CHUNKED
    full = _adder(kv_tokens=8, page_size=4)
    assert full.add_chunked(_req("long", 64)) is Admit.NO_ROOM


def test_reserved_tokens_is_the_remaining_outputs_scaled():
    reqs = [_req("a", 4, max_new_tokens=10), _req("b", 4, max_new_tokens=3)]
    reqs[0].num_scheduled_outputs = 4
    assert reserved_tokens(reqs, 1.0) == 6 + 3
    assert reserved_tokens(reqs, 0.5) == math.ceil(9 * 0.5)
