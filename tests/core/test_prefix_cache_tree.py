"""`RadixCache` on its own: matches, splits, locks, eviction, flush, and a state machine against a
naive reference (a dict from every cached page-aligned prefix to the page holding its last page).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stallfree.runtime.memory.pool import TokenToKVPoolAllocator
from stallfree.runtime.memory.radix_cache import RadixCache, TreeNode, common_prefix_len


def _cache(page_size: int = 1, pages: int = 64) -> RadixCache:
    allocator = TokenToKVPoolAllocator(pages * page_size, page_size)
    cache = RadixCache(allocator)
    allocator.evictor = cache
    return cache


def _insert(cache: RadixCache, tokens: list[int]) -> TreeNode:
    return _insert_pages(cache, tokens)[0]


def _insert_pages(cache: RadixCache, tokens: list[int]) -> tuple[TreeNode, list[int]]:
    """Insert as a finishing request would: fresh pages, the tree's duplicates freed."""
    ps = cache.page_size
    pages = cache.allocator.alloc_pages(len(tokens) // ps)
    assert pages is not None
    node, tree_pages = cache.insert(tokens, pages)
    dups = [p for p, t in zip(pages, tree_pages, strict=True) if p != t]
    cache.allocator.free_pages(dups)
    return node, pages


def _pool_whole(cache: RadixCache) -> None:
    cache.check()
    allocator = cache.allocator
    assert cache.cached_pages + allocator.free_page_count() == allocator.num_pages


def test_common_prefix_len():
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2
    assert common_prefix_len([2], [1]) == 0
    for cut in range(1, 40):
        a = list(range(40))
        b = a[:cut] + [-1] * (40 - cut)
        assert common_prefix_len(a, b) == cut


def test_match_is_whole_pages_and_splits_the_node():
    cache = _cache(page_size=4)
    _insert(cache, list(range(12)))  # three pages, one node
    assert len(cache.root.children) == 1
    # 10 tokens shared: two whole pages match; the node splits after them
    pages, node = cache.match_prefix([*range(10), 99, 99])
    assert len(pages) == 2 and len(node.key) == 8
    assert cache.match_len(list(range(7))) == 4  # rounded down, and no split needed to know
    _pool_whole(cache)
    # the split keeps the pages where they were
    full, _ = cache.match_prefix(list(range(12)))
    assert full[:2] == pages and len(full) == 3
    _pool_whole(cache)


def test_insert_keeps_the_trees_pages_and_reports_them():
    cache = _cache(page_size=2)
    _insert(cache, [1, 2, 3, 4])
    mine = cache.allocator.alloc_pages(3)
    assert mine is not None
    _, tree_pages = cache.insert([1, 2, 3, 4, 5, 6], mine)
    theirs, _ = cache.match_prefix([1, 2, 3, 4])
    assert tree_pages[:2] == theirs and tree_pages[2] == mine[2]
    cache.allocator.free_pages(mine[:2])  # the caller frees the copies the tree did not take
    _pool_whole(cache)


def test_locked_nodes_survive_eviction_and_lru_goes_first():
    cache = _cache(page_size=1, pages=16)
    a = _insert(cache, [1, 1, 1, 1])
    _insert(cache, [2, 2, 2, 2])
    _insert(cache, [3, 3, 3, 3])
    cache.match_prefix([2, 2, 2, 2])  # [2...] is now the most recent, [1...] the least
    assert cache.lock(a) == 4
    assert cache.evictable_pages() == 8
    assert cache.evict(6) == 6  # all of [3...] and the tail of [2...]
    assert cache.match_len([1, 1, 1, 1]) == 4
    assert cache.match_len([2, 2, 2, 2]) == 2  # trimmed, not dropped
    assert cache.match_len([3, 3, 3, 3]) == 0
    assert cache.evict(100) == 2  # only unlocked pages go
    assert not cache.flush()  # a lock is held
    cache.unlock(a)
    assert cache.flush()
    assert cache.cached_pages == 0
    _pool_whole(cache)
    assert cache.evicted_pages == 8


def test_lock_counts_once_per_path_and_unlock_checks():
    cache = _cache(page_size=1)
    leaf = _insert(cache, [5, 6, 7])
    pages, mid = cache.match_prefix([5, 6, 9])  # split after [5, 6]
    assert len(pages) == 2
    assert cache.lock(leaf) == 3
    assert cache.lock(mid) == 0  # already protected through the leaf's lock
    cache.unlock(leaf)
    assert cache.locked_pages == 2
    cache.unlock(mid)
    assert cache.locked_pages == 0
    with pytest.raises(RuntimeError):
        cache.unlock(mid)


def test_allocation_evicts_only_what_it_lacks():
    cache = _cache(page_size=1, pages=8)
    _insert(cache, list(range(6)))
    assert cache.allocator.available_pages() == 8
    assert cache.allocator.free_page_count() == 2
    got = cache.allocator.alloc_pages(3)
    assert got is not None and cache.cached_pages == 5  # one page evicted, not the whole node
    assert cache.allocator.alloc_pages(9) is None
    assert cache.cached_pages == 5  # a refused allocation evicts nothing
    cache.allocator.free_pages(got)
    _pool_whole(cache)


TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=12)


class TreeMachine(RuleBasedStateMachine):
    """The tree against a dict of every cached page-aligned prefix -> its last page."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.cache = _cache(page_size, pages=4096)
        self.ref: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []

    def _whole(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.ps]

    def _ref_match(self, tokens: list[int]) -> list[int]:
        pages = []
        for end in range(self.ps, len(self._whole(tokens)) + 1, self.ps):
            page = self.ref.get(tuple(tokens[:end]))
            if page is None:
                break
            pages.append(page)
        return pages

    def _tree_entries(self) -> dict[tuple[int, ...], int]:
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(self.cache.root, ())]
        while stack:
            node, prefix = stack.pop()
            for i, page in enumerate(node.pages):
                out[prefix + tuple(node.key[: (i + 1) * self.ps])] = page
            full = prefix + tuple(node.key)
            stack.extend((child, full) for child in node.children.values())
        return out

    def _locked_entries(self) -> set[tuple[int, ...]]:
        return {key[:end] for _, key in self.locks for end in range(self.ps, len(key) + 1, self.ps)}

    @rule(tokens=TOKENS)
    def insert(self, tokens: list[int]) -> None:
        tokens = self._whole(tokens)
        _, mine = _insert_pages(self.cache, tokens)
        for i, page in enumerate(mine):  # the tree keeps what it had, takes the rest
            self.ref.setdefault(tuple(tokens[: (i + 1) * self.ps]), page)

    @rule(tokens=TOKENS)
    def match(self, tokens: list[int]) -> None:
        want = self._ref_match(tokens)
        assert self.cache.match_len(tokens) == len(want) * self.ps
        pages, node = self.cache.match_prefix(tokens)  # may split
        assert pages == want
        assert sum(len(n.key) for n in _path(node)) == len(want) * self.ps

    @rule(tokens=TOKENS)
    def lock(self, tokens: list[int]) -> None:
        pages, node = self.cache.match_prefix(tokens)
        if not pages:
            return
        self.cache.lock(node)
        self.locks.append((node, tuple(tokens[: len(pages) * self.ps])))

    @precondition(lambda self: self.locks)
    @rule(which=st.integers(0, 1000))
    def unlock(self, which: int) -> None:
        node, _ = self.locks.pop(which % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 20))
    def evict(self, n: int) -> None:
        before = self._tree_entries()
        assert before == self.ref
        evictable = self.cache.evictable_pages()
        freed = self.cache.evict(n)
        after = self._tree_entries()
        assert freed == min(n, evictable)
        assert set(after) <= set(before) and len(before) - len(after) == freed
        assert self._locked_entries() <= set(after), "a locked page was evicted"
        self.ref = after

    @rule()
    def flush(self) -> None:
        done = self.cache.flush()
        assert done == (not self.locks)
        if done:
            self.ref = {}

    @invariant()
    def whole(self) -> None:
        if not hasattr(self, "cache"):
            return
        _pool_whole(self.cache)
        assert self._tree_entries() == self.ref
        locked = self._locked_entries()
        assert self.cache.locked_pages == len(locked)
        assert self.cache.evictable_pages() == len(self.ref) - len(locked)


def _path(node: TreeNode) -> list[TreeNode]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
