"""The scheduler and the KV-cache manager (train/serve/scheduler.py, pages.py) without a model: prefix hits share
pages by reference, idle cached pages are evicted least recently used, a short pool preempts the newest sequence
and readmits it first, rejected tokens' pages go back, and a reset forgets every cached prefix."""
from train.config.sections import ServeSection
from train.serve.pages import KVCacheManager, Pages, page_keys
from train.serve.sampling import SamplingParams
from train.serve.scheduler import Scheduler, Sequence

PAGE = 4


def _steps(scheduler, until) -> int:
    """Plan and complete steps (each sampled token 7) until `until()` holds; the steps taken."""
    steps = 0
    while not until():
        for chunk in scheduler.plan():
            scheduler.computed(chunk)
            if chunk.samples:
                chunk.seq.output.append(7)
                if len(chunk.seq.output) == chunk.seq.params.max_tokens:
                    scheduler.retire(chunk.seq)
        steps += 1
        assert steps < 200
    return steps


def test_a_prefix_hit_shares_the_cached_pages_by_reference():
    kv = KVCacheManager([16], [0], PAGE)
    prompt = list(range(14))  # 3 full pages and 2 tokens
    slice_of = lambda start, count: prompt[start:start + count]  # noqa: E731
    assert kv.cached_prefix("a", slice_of, len(prompt)) == 0 and kv.allocate("a", 0, 14)
    kv.commit("a", 14, slice_of)
    pages = kv.tables("a")[0][:3]
    assert kv.groups[0].cached == dict(zip(page_keys(slice_of, PAGE, 0, 3), pages))
    assert kv.cached_prefix("b", slice_of, len(prompt)) == 12 and kv.tables("b")[0] == pages
    assert [kv.groups[0].refs[p] for p in pages] == [2, 2, 2] and (kv.prefix_hits, kv.prefix_queries) == (3, 4)
    kv.free("a")
    kv.free("b")
    assert kv.used() == 0 and len(kv.groups[0].idle) == 3  # cached, held by none
    other = [99] + prompt[1:]  # another first token: every key differs
    assert kv.cached_prefix("c", lambda s, c: other[s:s + c], len(other)) == 0


def test_idle_cached_pages_are_evicted_least_recently_used():
    pages = Pages(4)
    held = [pages.allocate() for _ in range(3)]
    for key, page in zip("xyz", held):
        pages.register(key, page)
    for page in (held[1], held[0], held[2]):  # released in this order: y, x, z
        pages.release(page)
    assert pages.lookup("x") == held[0]  # held again: no longer idle
    pages.release(held[0])  # now the most recently released
    assert [pages.allocate() for _ in range(2)] == [held[1], held[2]] and set(pages.cached) == {"x"}
    assert pages.allocate() == held[0] and pages.allocate() is None and not pages.cached


def test_a_short_pool_preempts_the_newest_and_readmits_it_first():
    settings = ServeSection(page_size=PAGE, max_num_seqs=3, max_batch_tokens=16, prefill_chunk=8)
    kv = KVCacheManager([8], [0], PAGE, prefix_cache=False)  # 7 pages: 28 positions for three sequences
    scheduler = Scheduler(kv, settings)
    seqs = [Sequence(n, list(range(10 * i, 10 * i + 6)), SamplingParams(max_tokens=6), i)
            for i, n in enumerate("abc")]
    scheduler.waiting.extend(seqs)
    _steps(scheduler, lambda: scheduler.preemptions > 0)
    assert [s.request_id for s in scheduler.running] == ["a", "b"] and scheduler.waiting[0] is seqs[2]
    assert kv.held("c") == [0] and seqs[2].computed == 0 and seqs[2].slot == -1
    _steps(scheduler, lambda: not scheduler.running and not scheduler.waiting)
    assert all(len(s.output) == 6 for s in seqs) and kv.used() == 0


def test_rejected_tokens_pages_go_back_and_a_reset_forgets_the_cache():
    kv = KVCacheManager([16, 16], [0, 8], PAGE)
    tokens = list(range(40))
    slice_of = lambda start, count: tokens[start:start + count]  # noqa: E731
    assert kv.allocate("a", 0, 20)
    kv.commit("a", 20, slice_of)
    assert kv.held("a") == [5, 2]  # positions 0-19; the window of position 20 starts at 13: pages 3 and 4
    assert kv.allocate("a", 20, 30)  # ten speculative positions
    assert kv.held("a") == [8, 5]
    kv.truncate("a", 22)  # two kept: the pages of positions 22.. go back
    assert kv.held("a") == [6, 3] and len(kv.tables("a")[0]) == 6
    assert len(kv.groups[0].cached) == 5
    kv.reset_prefix_cache()
    assert not kv.groups[0].cached and not kv.groups[0].idle
    kv.commit("a", 24, slice_of)  # in flight across the reset: offers no page again
    assert not kv.groups[0].cached
    kv.free("a")
    assert kv.used() == 0 and kv.available() == 30
