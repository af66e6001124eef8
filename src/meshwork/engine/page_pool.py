"""The serving engine's page pool: which KV-cache pages each live sequence holds, and the prefix
cache that lets sequences share the full pages of a common prefix (src/meshwork/engine/serving.py explains
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
    """The pool's pages, reference-counted, with a prefix cache; split into `replicas` equal ranges.

    Replica r owns pages r*n/replicas .. (r+1)*n/replicas - 1, of which the
    first is its null page (never handed out). With one replica that is pages
    1..n-1 and null page 0. A sharded server keeps replica r's range on the
    devices of data-parallel replica r (kv_cache.py), so a sequence only ever
    holds pages of its own replica, and the prefix cache is per replica.

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

    def __init__(self, n_pages: int, replicas: int = 1):
        if replicas < 1 or n_pages % replicas or n_pages // replicas < 2:
            raise ValueError(
                f"{n_pages} pages cannot be split into {replicas} replicas of at least 2 pages "
                f"(a null page and one to hand out); use a multiple of {replicas} pages"
            )
        self.n_pages, self.replicas = n_pages, replicas
        self.per_replica = n_pages // replicas
        self._free = [
            collections.deque(range(r * self.per_replica + 1, (r + 1) * self.per_replica)) for r in range(replicas)
        ]
        self.owners: dict[int, list[Hashable]] = {}  # held pages -> the sequences holding them
        self._cached: list[dict[bytes, int]] = [{} for _ in range(replicas)]  # chained token hash -> page
        self.digest: dict[int, bytes] = {}  # the reverse, for registered pages
        # Per replica: cached pages no one holds, least recently released first.
        self._lru: list[collections.OrderedDict[int, None]] = [collections.OrderedDict() for _ in range(replicas)]
        self.evictions = 0

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out: all but the null pages."""
        return self.n_pages - self.replicas

    @property
    def free(self) -> list[int]:
        return [p for q in self._free for p in q]

    @property
    def lru(self) -> list[int]:
        """Cached pages that no sequence holds."""
        return [p for q in self._lru for p in q]

    @property
    def available(self) -> int:
        """Pages `allocate` can hand out, over all replicas: the free ones and the cached ones it may evict."""
        return sum(self.available_in(r) for r in range(self.replicas))

    def available_in(self, replica: int) -> int:
        return len(self._free[replica]) + len(self._lru[replica])

    def replica_of(self, page: int) -> int:
        return page // self.per_replica

    def null_page(self, replica: int) -> int:
        return replica * self.per_replica

    def allocate(self, owner: Hashable, n: int, replica: int = 0) -> list[int] | None:
        """n fresh pages of `replica` for `owner`, or None (nothing taken) when fewer are available."""
        if n > self.available_in(replica):
            return None
        free, lru, cached = self._free[replica], self._lru[replica], self._cached[replica]
        pages = []
        for _ in range(n):
            if free:
                pages.append(free.popleft())
            else:  # evict the least recently released cached page
                page, _ = lru.popitem(last=False)
                del cached[self.digest.pop(page)]
                self.evictions += 1
                pages.append(page)
        for p in pages:
            self.owners[p] = [owner]
        return pages

    def lookup(self, digests: Sequence[bytes], replica: int = 0) -> list[int]:
        """The pages of the longest run of `digests` (a sequence's full pages, in order) cached in `replica`."""
        pages = []
        for d in digests:
            if d not in self._cached[replica]:
                break
            pages.append(self._cached[replica][d])
        return pages

    def share(self, owner: Hashable, pages: Iterable[int]) -> None:
        """`owner` holds cached pages too (their keys/values are reused, never written)."""
        for p in pages:
            self._lru[self.replica_of(p)].pop(p, None)
            self.owners.setdefault(p, []).append(owner)

    def register(self, page: int, digest: bytes) -> None:
        """`page` now holds the full page of tokens that `digest` names; a digest already cached keeps
        its page (this one is freed as usual when released)."""
        cached = self._cached[self.replica_of(page)]
        if digest not in cached and page not in self.digest:
            cached[digest] = page
            self.digest[page] = digest

    def forget_cached(self) -> int:
        """Drops the prefix cache: every cached page no sequence holds is free again, and the free
        pages are handed out in their first order. For when the keys/values no longer match the
        model (new weights after a sync: src/meshwork/engine/weight_sync.py). Returns how many were dropped
        (held pages stay with their holders but are no longer found by `lookup`)."""
        dropped = len(self.digest)
        for r in range(self.replicas):
            self._free[r] = collections.deque(sorted([*self._free[r], *self._lru[r]]))
            self._lru[r].clear()
            self._cached[r].clear()
        self.digest.clear()  # held pages too: released later, they are freed, not cached
        return dropped

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
                self._lru[self.replica_of(p)][p] = None  # most recently released: evicted last
            else:
                self._free[self.replica_of(p)].append(p)


def page_digests(tokens: Sequence[int], page_size: int, previous: bytes = b"") -> list[bytes]:
    """Chained hashes of the full pages of `tokens`: page i's digest covers tokens 0..(i+1)*page_size-1,
    so equal digests mean equal prefixes, not just equal pages. `previous`: the digest before tokens[0]."""
    digests = []
    for i in range(len(tokens) // page_size):
        block = np.asarray(tokens[i * page_size : (i + 1) * page_size], np.int64).tobytes()
        previous = hashlib.sha256(previous + block).digest()
        digests.append(previous)
    return digests
