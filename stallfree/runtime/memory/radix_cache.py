"""`RadixCache`: a radix tree of KV pages shared across requests, decided on the host.

Keys are token ids, values are KV pages of the allocator. Every node holds a whole number of
pages (`len(key) == len(pages) * page_size`), so a match is always a run of whole pages and a
request's cached prefix ends on a page boundary.

Ownership:
- A page is either free in the allocator, held by the tree, or owned by one request. The pages
  the tree holds plus the allocator's free pages plus the pages requests own are the pool.
- A request that uses a cached prefix locks the node where its prefix ends. A lock counts on
  every node from there to the root. A locked node is never evicted.
- Eviction takes the least recently used unlocked leaves (and trims a leaf's tail pages when
  only part of it is needed). The allocator asks for it when an allocation finds too few free
  pages (`TokenToKVPoolAllocator.evictor`).

Nothing here touches the device: the tree is host data. Whoever writes a request's table row
uploads the page numbers it got from `match_prefix`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from stallfree.runtime.memory.pool import TokenToKVPoolAllocator


class PrefixCacheConfigError(ValueError):
    """A configuration that cannot run with prefix caching (HiSparse, for one)."""


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`, by slice comparisons (C speed)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TreeNode:
    __slots__ = ("children", "key", "last_access", "lock_ref", "pages", "parent")

    def __init__(self, key: list[int], pages: list[int], parent: TreeNode | None) -> None:
        self.key = key  # token ids, a whole number of pages
        self.pages = pages  # one KV page per `page_size` tokens of `key`
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # by the first page's token ids
        self.lock_ref = 0  # requests whose cached prefix runs through this node
        self.last_access = 0


class EvictionCounter(Protocol):
    """Where the cache counts what eviction frees (the engine's counters)."""

    prefix_cache_evicted_tokens: int


class RadixCache:
    def __init__(
        self, allocator: TokenToKVPoolAllocator, counters: EvictionCounter | None = None
    ) -> None:
        self.allocator = allocator
        self.counters = counters  # eviction adds to `prefix_cache_evicted_tokens`
        self.page_size = allocator.page_size
        self.root = TreeNode([], [], None)
        self.cached_pages = 0  # pages the tree holds
        self.locked_pages = 0  # of those, pages on a locked path
        self.evicted_pages = 0  # cumulative
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ queries

    def evictable_pages(self) -> int:
        """Pages eviction could return now: every unlocked node is, or becomes, a leaf."""
        return self.cached_pages - self.locked_pages

    def _page_key(self, tokens: Sequence[int], offset: int) -> tuple[int, ...]:
        return tuple(tokens[offset : offset + self.page_size])

    def _common_pages(self, key: list[int], tokens: Sequence[int], offset: int, limit: int) -> int:
        """Tokens (a multiple of the page size) that `key` shares with `tokens[offset:limit]`."""
        n = common_prefix_len(key, tokens[offset:limit])
        return n - n % self.page_size

    def _walk(self, tokens: Sequence[int]) -> tuple[TreeNode, int, list[int], TreeNode | None, int]:
        """Follow `tokens` (whole pages of it) without changing anything.

        Returns (deepest node fully matched, tokens matched to it, its pages from the root,
        the child matched part way or None, tokens matched inside that child).
        """
        ps = self.page_size
        limit = len(tokens) - len(tokens) % ps
        node, off, pages = self.root, 0, []
        while off < limit:
            child = node.children.get(self._page_key(tokens, off))
            if child is None:
                break
            klen = len(child.key)
            if off + klen <= limit and child.key == tokens[off : off + klen]:
                pages.extend(child.pages)
                node, off = child, off + klen
                continue
            return node, off, pages, child, self._common_pages(child.key, tokens, off, limit)
        return node, off, pages, None, 0

    def match_len(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` the tree holds (whole pages). Changes nothing, not even the LRU."""
        _, off, _, _, inside = self._walk(tokens)
        return off + inside

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], TreeNode]:
        """The longest cached prefix of `tokens`, in whole pages: (its pages, the node it ends at).

        A match that ends inside a node splits it, so the returned node ends exactly there. The
        path is marked as used now (LRU). Lock the node to keep the pages.
        """
        node, _, pages, partial, inside = self._walk(tokens)
        if partial is not None and inside:
            node = self._split(partial, inside)
            pages.extend(node.pages)
        self._touch(node)
        return pages, node

    # ------------------------------------------------------------------ changes

    def _touch(self, node: TreeNode) -> None:
        now = next(self._clock)
        while node is not self.root:
            node.last_access = now
            node = node.parent  # type: ignore[assignment]

    def _split(self, child: TreeNode, tokens: int) -> TreeNode:
        """Cut `child` after `tokens` (a whole number of pages); returns the new upper part."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < tokens < len(child.key) and tokens % ps == 0
        upper = TreeNode(child.key[:tokens], child.pages[: tokens // ps], parent)
        upper.lock_ref = child.lock_ref  # every lock through `child` runs through `upper`
        upper.last_access = child.last_access
        parent.children[self._page_key(upper.key, 0)] = upper
        child.key = child.key[tokens:]
        child.pages = child.pages[tokens // ps :]
        child.parent = upper
        upper.children[self._page_key(child.key, 0)] = child
        return upper

    def insert(self, tokens: Sequence[int], pages: list[int]) -> tuple[TreeNode, list[int]]:
        """Cache `pages` as the KV of `tokens[: len(pages) * page_size]`.

        Where the tree already holds some of those tokens it keeps its own pages. Returns (the
        node the sequence ends at, the tree's pages for the whole sequence): a caller frees each
        of its pages that differs from the tree's at the same index, because the tree did not
        take it. The new nodes are unlocked.
        """
        ps = self.page_size
        n = len(pages) * ps
        assert len(tokens) >= n, "fewer tokens than pages"
        node, off, tree_pages, partial, inside = self._walk(tokens[:n])
        if partial is not None:
            node = self._split(partial, inside)
            tree_pages.extend(node.pages)
            off += inside
        if off < n:
            leaf = TreeNode(list(tokens[off:n]), pages[off // ps :], node)
            node.children[self._page_key(leaf.key, 0)] = leaf
            self.cached_pages += len(leaf.pages)
            if leaf.lock_ref:  # never: a new leaf is unlocked
                self.locked_pages += len(leaf.pages)
            tree_pages.extend(leaf.pages)
            node = leaf
        self._touch(node)
        return node, tree_pages

    def lock(self, node: TreeNode) -> int:
        """Lock the path from `node` to the root. Returns the pages that were evictable before."""
        moved = 0
        while node is not self.root:
            if node.lock_ref == 0:
                moved += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        self.locked_pages += moved
        return moved

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a prefix-cache node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_pages -= len(node.pages)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages (if the unlocked ones suffice), least recent first.

        Only unlocked leaves go; a leaf bigger than what is still needed loses its tail pages
        and stays. Returns the pages freed.
        """
        if num_pages <= 0:
            return 0
        heap: list[tuple[int, int, TreeNode]] = []
        order = itertools.count()
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.lock_ref == 0:
                heap.append((node.last_access, next(order), node))
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            need = num_pages - freed
            if len(node.pages) > need:  # trim the tail; the leaf keeps its head
                tail = node.pages[-need:]
                node.pages = node.pages[:-need]
                node.key = node.key[: len(node.pages) * self.page_size]
                self.allocator.free_pages(tail)
                freed += need
                self.cached_pages -= need
                break
            parent = node.parent
            assert parent is not None
            del parent.children[self._page_key(node.key, 0)]
            self.allocator.free_pages(node.pages)
            freed += len(node.pages)
            self.cached_pages -= len(node.pages)
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        self.evicted_pages += freed
        if self.counters is not None:
            self.counters.prefix_cache_evicted_tokens += freed * self.page_size
        return freed

    def flush(self) -> bool:
        """Free every cached page. Refused (False) while any request holds a lock."""
        if self.locked_pages:
            return False
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self.allocator.free_pages(node.pages)
        self.root.children = {}
        self.cached_pages = 0
        return True

    # ------------------------------------------------------------------ debug

    def check(self) -> None:
        """Debug only: every structural invariant of the tree (tests call it)."""
        ps = self.page_size
        total = locked = 0
        stack = [self.root]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            child_locks = 0
            for key, child in node.children.items():
                assert child.parent is node, "child with a wrong parent"
                assert key == self._page_key(child.key, 0), "child under a wrong key"
                assert child.pages and len(child.key) == len(child.pages) * ps, "not whole pages"
                assert child.lock_ref >= 0
                child_locks += child.lock_ref
                stack.append(child)
            if node is not self.root:
                assert node.lock_ref >= child_locks, "a lock does not reach the root"
                total += len(node.pages)
                locked += len(node.pages) if node.lock_ref else 0
                for p in node.pages:
                    assert p not in seen, f"page {p} held twice"
                    seen.add(p)
        assert total == self.cached_pages, (total, self.cached_pages)
        assert locked == self.locked_pages, (locked, self.locked_pages)
