"""The KV-cache manager's pages per cache group (train/serve/pages.py) under the scheduler, without a model: a
sliding group's sequence holds its window's pages alone and gives the others back while a causal group's grows; the
prefix cache reuses both kinds' pages; a sliding group too small preempts as a causal one does."""
from train.config.sections import ServeSection
from train.serve.pages import KVCacheManager
from train.serve.sampling import SamplingParams
from train.serve.scheduler import Scheduler, Sequence

PAGE, WINDOW = 4, 8


def _scheduler(causal_pages=64, sliding_pages=16, **settings):
    settings = ServeSection(**{"page_size": PAGE, "max_num_seqs": 4, "max_batch_tokens": 16, "prefill_chunk": 8,
                               **settings})
    return Scheduler(KVCacheManager([causal_pages, sliding_pages], [0, WINDOW], PAGE), settings)


def _run(scheduler, seq, tokens_out: int) -> list[list[int]]:
    """Step until `seq` has `tokens_out` new tokens (token 7 each step); the pages it holds after each step."""
    held = []
    while len(seq.output) < tokens_out:
        chunks = scheduler.plan()
        for chunk in chunks:
            scheduler.computed(chunk)
            if chunk.samples:
                chunk.seq.output.append(7)
        held.append(scheduler.kv.held(seq.request_id))
    return held


def test_a_sliding_group_holds_its_window_while_a_causal_group_grows():
    scheduler = _scheduler()
    seq = Sequence("a", list(range(20)), SamplingParams(max_tokens=40), 0)
    scheduler.waiting.append(seq)
    held = _run(scheduler, seq, 30)
    causal, sliding = zip(*held)
    assert causal[-1] == -(-seq.length() // PAGE) == 13 and max(sliding[3:]) == -(-WINDOW // PAGE) + 1
    kv = scheduler.kv
    assert kv.groups[1].used() == sliding[-1]  # the passed pages went back
    released = kv.tables("a")[1][:kv.first_needed(WINDOW, seq.computed)]
    assert released and set(released) == {0}


def test_the_prefix_cache_reuses_both_kinds_of_pages():
    scheduler = _scheduler()
    prompt = list(range(100, 124))  # 6 full pages
    first = Sequence("a", prompt, SamplingParams(max_tokens=2), 0)
    scheduler.waiting.append(first)
    _run(scheduler, first, 2)
    scheduler.retire(first)
    second = Sequence("b", prompt + [1, 2], SamplingParams(max_tokens=2), 1)
    scheduler.waiting.append(second)
    scheduler.plan()
    # All 6 pages hit in the causal group; in the sliding group the pages the next position's window reaches.
    assert second.computed == 24 and scheduler.kv.prefix_hits == 6
    tables = scheduler.kv.tables("b")
    assert [p != 0 for p in tables[1][:6]] == [False] * 4 + [True] * 2  # positions 17.. of 24
    assert tables[0][:6] == first_pages(scheduler, prompt)


def first_pages(scheduler, prompt):
    """The causal group's cached pages of `prompt`'s full pages, by prefix key."""
    key, out = None, []
    for i in range(len(prompt) // PAGE):
        key = (key, tuple(prompt[i * PAGE:(i + 1) * PAGE]))
        out.append(scheduler.kv.groups[0].cached[key])
    return out


def test_a_short_sliding_group_preempts_the_newest_sequence():
    scheduler = _scheduler(sliding_pages=7, prefill_chunk=4, max_batch_tokens=8)  # 6 pages: two windows of 3
    seqs = [Sequence(name, list(range(8)), SamplingParams(max_tokens=20), i) for i, name in enumerate("abc")]
    scheduler.waiting.extend(seqs)
    for _ in range(12):
        for chunk in scheduler.plan():
            scheduler.computed(chunk)
            if chunk.samples:
                chunk.seq.output.append(7)
        assert scheduler.kv.groups[1].used() <= 6
    assert scheduler.preemptions > 0 and seqs[0] in scheduler.running
