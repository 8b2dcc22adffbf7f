"""The block manager's account (dllm.block_manager): reference counts, the one LRU free list, the prefix cache
keyed by tokens and weight version, pages owed by the step that writes them, retirement of old versions."""

import pytest

from dllm.block_manager import BlockManager, CacheFull, KVBudget, block_keys
from dllm.sampling import SamplingParams
from dllm.sequence import Sequence

B = 4


def seq(prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(prompt, SamplingParams(max_tokens=max_tokens), B, 63)


def manager(num_pages: int = 12, num_slots: int = 4, **kw) -> BlockManager:
    return BlockManager(KVBudget(num_slots, num_pages, B, max_pages=8, prefix_sharing=True, **kw))


def test_keys_chain_the_prefix_and_the_version():
    a = block_keys(list(range(1, 13)), B, 0)
    assert len(a) == 3 and len(set(a)) == 3 and block_keys(list(range(1, 11)), B, 0) == a[:2]  # complete blocks
    other = block_keys([9, 2, 3, 4] + list(range(5, 13)), B, 0)
    assert other[0] != a[0] and other[1] != a[1]  # a later block's key depends on every block before it
    assert set(block_keys(list(range(1, 13)), B, 1)).isdisjoint(a)  # another weight version: other keys


def test_samples_share_their_prompt_and_pages_come_back_once():
    bm = manager()
    prompt = list(range(1, 10))  # 2 complete blocks + 1 token: 9 + 4 tokens = 4 pages each
    a, b = seq(prompt), seq(prompt)
    bm.admit(a, 0)
    assert len(a.block_table) == 4 and a.num_cached_tokens == 0 and bm.num_free_pages == 8
    assert bm.can_admit(b, 0)
    bm.admit(b, 0)  # same step: a's prompt pages are owed by a's forward, already shared
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2:] != a.block_table[2:]
    assert b.num_cached_tokens == 8 and bm.num_free_pages == 6 and bm.num_used_pages == 6
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (18, 8)
    bm.confirm()
    bm.release(a)
    bm.release(a)  # once
    assert bm.num_free_pages == 8 and a.block_table == [] and b.block_table[:2] != [0, 0]
    bm.release(b)
    assert bm.num_free_pages == 12 and bm.num_cached_pages == 2 and bm.num_free_slots == 4
    c = seq(prompt + [5])  # a longer prompt with the same first blocks: found after its samples ended
    bm.admit(c, 0)
    assert c.num_cached_tokens == 8 and bm.num_hit_tokens == 16


def test_cached_pages_are_evicted_least_recently_used_and_only_when_needed():
    bm = manager(num_pages=6, num_slots=2)
    x, y = seq([1] * 8, 1), seq([2] * 8, 1)  # 2 complete prompt blocks + 1 page each
    for s in (x, y):
        bm.admit(s, 0)
    bm.confirm()
    bm.release(x)
    bm.release(y)  # released last: evicted last
    assert bm.num_cached_pages == 4 and bm.num_free_pages == 6
    big = seq([3] * 8, 4)  # 3 pages: the 2 that cache nothing first, then x's last block (least recent)
    bm.admit(big, 0)
    assert bm.num_evicted == 1 and bm.num_cached_pages == 1 + 2 + 2  # x's first block, y's, big's own
    bm.confirm()
    again = seq([2] * 8, 1)  # y's prompt: both its blocks revived from the free list, 1 page taken
    bm.admit(again, 0)
    assert again.num_cached_tokens == 8 and bm.num_evicted == 2 and bm.num_free_pages == 0
    with pytest.raises(CacheFull):
        bm.admit(seq([1] * 8, 1), 0)  # no slot and no page left


def test_a_failed_step_caches_nothing_it_was_to_write():
    bm = manager()
    a = seq(list(range(1, 10)))
    bm.admit(a, 0)
    bm.forget_owed()  # the forward raised before writing a's prompt pages
    bm.release(a)
    b = seq(list(range(1, 10)))
    bm.admit(b, 0)
    assert b.num_cached_tokens == 0 and bm.num_hit_tokens == 0


def test_a_new_version_never_reads_older_pages_and_retires_them():
    bm = manager()
    prompt = list(range(1, 10))
    old = seq(prompt)
    bm.admit(old, 0)
    bm.confirm()
    assert bm.retire(1) == 0  # old's pages are in use: kept for it (its own version), not for version 1
    new = seq(prompt)
    bm.admit(new, 1)
    assert new.num_cached_tokens == 0 and set(new.block_table).isdisjoint(old.block_table)
    bm.confirm()
    bm.release(old)  # an older version's page with no reference left: uncached at once
    assert bm.num_cached_pages == 2  # only version 1's blocks
    bm.release(new)
    late = seq(prompt)
    bm.admit(late, 0)  # a preempted version-0 sequence coming back finds nothing of version 0 ...
    assert late.num_cached_tokens == 0
    bm.release(late)
    assert bm.retire(2) == 2 and bm.num_cached_pages == 0  # ... and version 2 retires version 1's free pages


def test_optimistic_growth_and_the_deficit():
    bm = BlockManager(KVBudget(2, 3, B, optimistic=True, max_pages=8))
    a, b = seq([1, 2], 8), seq([3], 8)
    bm.admit(a, 0)
    bm.admit(b, 0)
    assert len(a.block_table) == len(b.block_table) == 1 and bm.deficit([a, b]) == 0
    a.block_done = b.block_done = True  # each needs its next block's page
    assert bm.deficit([a, b]) == 1
    bm.grow(a)
    assert len(a.block_table) == 2 and bm.tables is not None and list(bm.tables[a.slot][:2]) == a.block_table
    with pytest.raises(CacheFull):
        bm.grow(b)

