"""The serving engine's page pool: which KV-cache pages each live sequence holds, and the prefix
cache that lets sequences share the full pages of a common prefix (inference/serving.py explains
how the engine uses them).

    pages = PageAllocator(n_pages=64)
    digests = page_digests(prompt_ids, page_size=16)   # chained: equal digests mean equal prefixes
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Hashable, Iterable, Sequence

import numpy as np


class PageAllocator:
    """Pages 1..n-1 of the pool (0 is the null page), reference-counted, with a prefix cache.

    A page is free, held (by one or more sequences; `owners`), or cached: no
    longer held but still holding the keys/values of a full page of tokens,
    found by the chained hash of those tokens (`lookup`) and handed out again
    as it is (`share`). Cached pages are evicted least recently released first
    when `allocate` runs out of free ones.

        pages = PageAllocator(8)
        a = pages.allocate("a", 2); pages.register(a[0], digest)  # a's first page is full
        pages.release("a", a)                                     # a[0] stays cached, a[1] is free
        pages.lookup([digest]) == a[:1]; pages.share("b", a[:1])
    """

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.free: collections.deque[int] = collections.deque(range(1, n_pages))
        self.owners: dict[int, list[Hashable]] = {}          # held pages -> the sequences holding them
        self.cached: dict[bytes, int] = {}                    # chained token hash -> page
        self.digest: dict[int, bytes] = {}                    # the reverse, for registered pages
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, not held
        self.evictions = 0

    @property
    def available(self) -> int:
        """Pages `allocate` can hand out: the free ones and the cached ones it may evict."""
        return len(self.free) + len(self.lru)

    def allocate(self, owner: Hashable, n: int) -> list[int] | None:
        """n fresh pages for `owner`, or None (nothing taken) when fewer are available."""
        if n > self.available:
            return None
        pages = []
        for _ in range(n):
            if self.free:
                pages.append(self.free.popleft())
            else:  # evict the least recently released cached page
                page, _ = self.lru.popitem(last=False)
                del self.cached[self.digest.pop(page)]
                self.evictions += 1
                pages.append(page)
        for p in pages:
            self.owners[p] = [owner]
        return pages

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `digests` (a sequence's full pages, in order) that is cached."""
        pages = []
        for d in digests:
            if d not in self.cached:
                break
            pages.append(self.cached[d])
        return pages

    def share(self, owner: Hashable, pages: Iterable[int]) -> None:
        """`owner` holds cached pages too (their keys/values are reused, never written)."""
        for p in pages:
            self.lru.pop(p, None)
            self.owners.setdefault(p, []).append(owner)

    def register(self, page: int, digest: bytes) -> None:
        """`page` now holds the full page of tokens that `digest` names; a digest already cached keeps
        its page (this one is freed as usual when released)."""
        if digest not in self.cached and page not in self.digest:
            self.cached[digest] = page
            self.digest[page] = digest

    def release(self, owner: Hashable, pages: Iterable[int]) -> None:
        for p in pages:
            holders = self.owners.get(p, [])
            if owner not in holders:
                raise RuntimeError(f"page {p} released by {owner!r}, which does not own it")
            holders.remove(owner)
            if holders:
                continue
            del self.owners[p]
            if p in self.digest:
                self.lru[p] = None  # most recently released: evicted last
            else:
                self.free.append(p)


def page_digests(tokens: Sequence[int], page_size: int, previous: bytes = b"") -> list[bytes]:
    """Chained hashes of the full pages of `tokens`: page i's digest covers tokens 0..(i+1)*page_size-1,
    so equal digests mean equal prefixes, not just equal pages. `previous`: the digest before tokens[0]."""
    digests = []
    for i in range(len(tokens) // page_size):
        block = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes()
        previous = hashlib.sha256(previous + block).digest()
        digests.append(previous)
    return digests
