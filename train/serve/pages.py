"""The KV cache's pages on the host. `Pages` is one cache group's allocator: pages handed out and reference counted,
full pages kept under a key of every token up to their end (prefix caching) and evicted least recently used once no
sequence holds them; page 0 is the scratch page padding tokens write to, never handed out. `KVCacheManager` owns
every sequence's pages in every cache group and its prefix keys (after vLLM v1's KV-cache manager): the scheduler
asks it only for counts (the prompt tokens the cache already holds, whether n more tokens fit) and frees victims."""
from __future__ import annotations

import collections
from typing import Callable, Hashable

from mesh.numbers import ceil_div


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

    def forget_cached(self) -> None:
        """Empty the prefix cache: idle cached pages become free, held ones private to their holders."""
        self.free.extend(self.idle)
        self.idle.clear()
        self.cached.clear()
        self.key_of.clear()


def page_keys(token_slice: Callable[[int, int], list[int]], page_size: int, start: int, stop: int,
              before: Hashable = None) -> list[Hashable]:
    """The prefix keys of full pages start..stop-1: each is (the key of the page before, the page's tokens), so a
    key stands for every token up to its page's end. `token_slice(first, count)` reads the tokens; `before` is the
    key of page start-1 (None for page 0)."""
    keys = []
    for i in range(start, stop):
        before = (before, tuple(token_slice(i * page_size, page_size)))
        keys.append(before)
    return keys


class KVCacheManager:
    """Every sequence's pages, by request id: per cache group (one `Pages` each, models/paged.cache_groups) a list
    of page ids by position // page_size. A causal group (window 0) keeps every page; a sliding group of `window`
    holds only the pages its window still reaches and gives back (0 in the list) the ones it has passed."""

    def __init__(self, group_pages: list[int], windows: list[int], page_size: int, prefix_cache: bool = True):
        self.groups = [Pages(n) for n in group_pages]
        self.windows, self.page_size, self.prefix_cache = list(windows), page_size, prefix_cache
        self._pages: dict[str, list[list[int]]] = {}
        # The prefix keys of a sequence's registered full pages; None: it offers none (computed before a reset).
        self._keys: dict[str, list[Hashable] | None] = {}
        self.prefix_hits = self.prefix_queries = 0

    def first_needed(self, window: int, position: int) -> int:
        """The first page a token at `position` (or any later) reads in a group of `window` (0: every page)."""
        return max(0, position - window + 1) // self.page_size if window else 0

    def tables(self, rid: str) -> list[list[int]]:
        """The page ids of `rid` in each group, by position // page_size (0: none, or given back)."""
        return self._pages.get(rid) or [[] for _ in self.groups]

    def held(self, rid: str) -> list[int]:
        """How many pages `rid` holds in each group."""
        return [sum(1 for page in held if page) for held in self.tables(rid)]

    def used(self) -> int:
        return sum(p.used() for p in self.groups)

    def available(self) -> int:
        return sum(p.available() for p in self.groups)

    def cached_prefix(self, rid: str, token_slice: Callable[[int, int], list[int]], length: int) -> int:
        """Take the cached pages of a new sequence's leading full pages (at least its last token is left to compute,
        whose logits choose the next one): the most pages n for which every causal group holds pages 0..n-1 and
        every sliding group those its window reaches from position n * page_size. Returns the tokens they hold."""
        if not self.prefix_cache or rid in self._pages:
            return 0
        keys = page_keys(token_slice, self.page_size, 0, (length - 1) // self.page_size)
        n = self._reusable(keys)
        self.prefix_queries += min(n + 1, len(keys))
        self.prefix_hits += n
        tables = self._pages[rid] = [[] for _ in self.groups]
        for pages, window, held in zip(self.groups, self.windows, tables):
            first = self.first_needed(window, n * self.page_size)
            held += [0] * first + [pages.lookup(k) for k in keys[first:n]]
        self._keys[rid] = keys[:n]
        return n * self.page_size

    def _reusable(self, keys: list[Hashable]) -> int:
        """The most leading pages of `keys` the groups hold cached, as `cached_prefix` needs them."""
        hit = [[k in pages.cached for k in keys] for pages in self.groups]
        n = len(keys)
        for window, cached in zip(self.windows, hit):
            if not window:
                n = min(n, cached.index(False) if False in cached else len(cached))
        while n and not all(all(cached[self.first_needed(w, n * self.page_size):n])
                            for w, cached in zip(self.windows, hit) if w):
            n -= 1
        return n

    def allocate(self, rid: str, computed: int, upto: int) -> bool:
        """Pages for positions computed..upto-1 (and, in a causal group, every one before); False, nothing taken,
        when a group is short."""
        tables = self._pages.setdefault(rid, [[] for _ in self.groups])
        last = ceil_div(upto, self.page_size)
        missing = []
        for pages, window, held in zip(self.groups, self.windows, tables):
            held += [0] * (last - len(held))
            missing.append([i for i in range(self.first_needed(window, computed), last) if not held[i]])
            if len(missing[-1]) > pages.available():
                return False
        for pages, held, indices in zip(self.groups, tables, missing):
            for i in indices:
                held[i] = pages.allocate()
        return True

    def commit(self, rid: str, computed: int, token_slice: Callable[[int, int], list[int]]) -> None:
        """After a step: positions 0..computed-1 hold their keys and values. The full pages among them join the
        prefix cache; a sliding group's pages before the window of position `computed` go back (to the cache's
        idle pages when registered)."""
        tables = self._pages[rid]
        keys = self._keys.setdefault(rid, []) if self.prefix_cache else None
        if keys is not None:
            new = page_keys(token_slice, self.page_size, len(keys), computed // self.page_size,
                            keys[-1] if keys else None)
            for i, key in enumerate(new, start=len(keys)):
                for pages, held in zip(self.groups, tables):
                    if held[i]:
                        pages.register(key, held[i])
            keys += new
        for pages, window, held in zip(self.groups, self.windows, tables):
            for i in range(self.first_needed(window, computed)):
                if held[i]:
                    pages.release(held[i])
                    held[i] = 0

    def truncate(self, rid: str, length: int) -> None:
        """Give back the pages past the first `length` positions (rejected speculative tokens' pages)."""
        keep = ceil_div(length, self.page_size)
        for pages, held in zip(self.groups, self.tables(rid)):
            while len(held) > keep:
                page = held.pop()
                if page:
                    pages.release(page)

    def free(self, rid: str) -> None:
        """Every page of `rid` back (its registered full pages stay in the prefix cache, idle)."""
        for pages, held in zip(self.groups, self._pages.pop(rid, ())):
            for page in held:
                if page:
                    pages.release(page)
        self._keys.pop(rid, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (new weights make them stale): idle pages become free; a sequence in flight
        keeps its pages but offers none of them to the cache again."""
        for pages in self.groups:
            pages.forget_cached()
        self._keys = dict.fromkeys(self._pages)
