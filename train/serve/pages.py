"""The KV page allocator: pages handed out and reference counted, full prompt pages kept under a key of every
token before them (prefix caching) and evicted least recently used once no sequence holds them. Page 0 is the
scratch page that padding tokens write to; it is never handed out."""
from __future__ import annotations

import collections
from typing import Hashable


class Pages:
    def __init__(self, num_pages: int):
        assert num_pages >= 2, num_pages
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.free = collections.deque(range(1, num_pages))
        self.cached: dict[Hashable, int] = {}   # prefix key -> page
        self.key_of: dict[int, Hashable] = {}   # page -> its prefix key
        self.idle = collections.OrderedDict()   # cached pages no sequence holds, oldest first

    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def used(self) -> int:
        return self.num_pages - 1 - self.available()

    def allocate(self) -> int | None:
        """A fresh page (ref 1), evicting the least recently used idle cached page if none is free."""
        if self.free:
            page = self.free.popleft()
        elif self.idle:
            page, _ = self.idle.popitem(last=False)
            del self.cached[self.key_of.pop(page)]
        else:
            return None
        self.refs[page] = 1
        return page

    def release(self, page: int) -> None:
        self.refs[page] -= 1
        assert self.refs[page] >= 0, page
        if self.refs[page] == 0:
            if page in self.key_of:
                self.idle[page] = None
            else:
                self.free.append(page)

    def lookup(self, key: Hashable) -> int | None:
        """The cached page of `key`, now held once more by the caller; None on a miss."""
        page = self.cached.get(key)
        if page is not None:
            self.idle.pop(page, None)
            self.refs[page] += 1
        return page

    def register(self, key: Hashable, page: int) -> None:
        """Offer a full page under its prefix key (the first page of a key wins; later copies stay private)."""
        if key not in self.cached and page not in self.key_of:
            self.cached[key] = page
            self.key_of[page] = key
