"""The block manager: every KV page and slot of a runner's cache, owned by the scheduler (dllm.scheduler).

    bm = BlockManager(KVBudget(num_slots=16, num_pages=2048, page_tokens=4, max_pages=2048, prefix_sharing=True))
    bm.can_admit(seq, version)   # a free slot, and free pages for what the sequence holds beyond its cached prefix
    bm.admit(seq, version)       # seq.slot, seq.block_table (cached prompt pages first), seq.num_cached_tokens
    bm.deficit(running)          # optimistic admission: pages the running sequences' next blocks still lack
    bm.grow(seq)                 # optimistic admission: the pages of its next block
    bm.release(seq)              # its pages (reference counts) and slot back; cached pages stay, evictable
    bm.confirm()                 # the step that computes this step's new prompt pages ran: they may serve others
    bm.forget_owed()             # it failed: those pages are not cached
    bm.retire(version)           # a new weight version: every cached page of an older version is dropped
    bm.tables                    # [num_slots, max_pages] int64: each slot's page table, read by the runner

Pages hold `page_tokens` tokens (the block size: page j of a sequence holds positions [j B, (j + 1) B));
page 0 is the runner's scratch page and never handed out. A sequence holds its pages in `seq.block_table`
(and its slot's row of `tables`, the same numbers), written only here. Each page has a reference count;
pages with none sit on the one free list, an LRU order: pages that cache nothing first, then cached
pages in the order they were last released -- a new page is taken from its head, evicting the cache
entry of a cached one.

Prefix sharing (`KVBudget.prefix_sharing`, block-causal models): the K/V of a complete prompt block
depend only on the tokens up to its end, so every complete prompt block is keyed by a chained hash
(BLAKE2b, 16 bytes) of the weight version and the token ids of it and of every block before it. On
admission a sequence looks its blocks up in order and shares every page found (reference count + 1),
up to the first miss; `seq.num_cached_tokens` is then the prefix whose K/V it need not compute. The
pages it takes for its missing complete prompt blocks are registered under their keys at once, so
the other samples of its request admitted in the same step share them too: the runner writes them in
that step's forward, before any row reads them (its prefill rows, then its decode rows, each layer
writing before reading). They are "owed" until `confirm()` (after the step ran); a step that failed
calls `forget_owed()`, and the pages are freed uncached. Cached pages outlive their sequences (a
released page with no other reference stays on the free list, still findable) and are evicted in LRU
order when a page is needed. The version is part of the key -- a sequence of version v only ever
reads pages computed by the weights of version v -- and `retire(v)` drops every free cached page of
an older version (a page still held by an older sequence is dropped when it is released). A sequence
keeps its version across preemption, so it looks up its own version's pages when re-admitted.

Counters (the server's dlrl_prefix_cache_queries_total / _hits_total, as vLLM's): `num_queried_tokens`
(prompt tokens of every admission) and `num_hit_tokens` (those whose K/V came from the cache).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from dllm.sequence import Sequence


class CacheFull(RuntimeError):
    """An allocation the account did not allow for (a caller out of step with `can_admit` / `deficit`)."""


@dataclass(frozen=True)
class KVBudget:
    """A runner's KV cache as the scheduler accounts for it (`runner.kv_budget`)."""

    num_slots: int        # sequences at once (rows of the page tables)
    num_pages: int = 0    # pages in the pool; 0 = unpaged (only slots count)
    page_tokens: int = 1  # tokens per page (the block size)
    optimistic: bool = False  # admit on the next forward's pages, grow per block, preempt (dllm.scheduler)
    max_pages: int = 0    # pages of one sequence at most (its page-table row); 0 = num_pages
    prefix_sharing: bool = False  # complete prompt blocks shared by key (block-causal runners only)

    def pages_for(self, seq: Sequence) -> int:
        """Pages a sequence holds now: prompt + max_tokens (optimistic: up to its next forward's block end)."""
        if not self.num_pages:
            return 0
        if not self.optimistic:
            tokens = len(seq.prompt_ids) + int(seq.params.max_tokens)
        else:
            tokens = seq.end_pos + (seq.block_size if seq.block_done else 0)
        return min(-(-tokens // self.page_tokens), self.row_pages)

    @property
    def row_pages(self) -> int:
        return self.max_pages or self.num_pages

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds at once."""
        return self.num_pages * self.page_tokens


def block_keys(prompt_ids: list[int], page_tokens: int, version: int) -> list[bytes]:
    """The chained keys of a prompt's complete blocks under weight `version`: key j hashes the version
    and the token ids of blocks 0..j (so equal keys mean an equal prefix, computed by the same weights)."""
    n = len(prompt_ids) // page_tokens
    raw = np.asarray(prompt_ids[:n * page_tokens], dtype=np.int64).tobytes()
    step = 8 * page_tokens
    key = b"dlrl-kv" + int(version).to_bytes(8, "little", signed=True)
    keys = []
    for j in range(n):
        key = hashlib.blake2b(key + raw[j * step:(j + 1) * step], digest_size=16).digest()
        keys.append(key)
    return keys


class BlockManager:
    """Slots, pages, reference counts, the one free list and the prefix cache (see the module docstring)."""

    def __init__(self, budget: KVBudget) -> None:
        self.budget = budget
        self.sharing = budget.prefix_sharing and budget.num_pages > 0
        self._free_slots = list(range(budget.num_slots))[::-1]
        self._held: dict[int, Sequence] = {}  # seq_id -> a sequence holding a slot
        self._ref = [0] * (budget.num_pages + 1)  # references per page (page 0: scratch, never handed out)
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, budget.num_pages + 1))
        self._page_of: dict[bytes, int] = {}  # key -> cached page
        self._key_of: dict[int, tuple[bytes, int]] = {}  # cached page -> (key, weight version)
        self._owed: list[int] = []  # pages registered this step, written by this step's forward
        self.version = 0  # the newest weight version seen (retire)
        self.tables = (np.zeros((budget.num_slots, budget.row_pages), dtype=np.int64)
                       if budget.num_pages else None)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted = 0

    # ------------------------------------------------------------------ reading
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_pages(self) -> int:
        """Pages a new sequence can take: unused ones and cached ones no running sequence holds."""
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        """Pages held by running sequences (each counted once, however many share it)."""
        return self.budget.num_pages - len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_of)

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self._held

    # ------------------------------------------------------------------ admission
    def _lookup(self, seq: Sequence, version: int) -> tuple[list[bytes], list[int]]:
        """(keys of its complete prompt blocks, the cached pages of its longest cached prefix)."""
        if not self.sharing:
            return [], []
        if seq.prefix_keys is None or seq.prefix_keys[0] != version:
            seq.prefix_keys = (version, block_keys(seq.prompt_ids, self.budget.page_tokens, version))
        keys = seq.prefix_keys[1]
        hits = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            hits.append(page)
        return keys, hits

    def _takes(self, seq: Sequence, hits: list[int]) -> int:
        """Free-list pages an admission takes: its new pages, and the cached pages it revives."""
        return self.budget.pages_for(seq) - len(hits) + sum(1 for p in hits if not self._ref[p])

    def can_admit(self, seq: Sequence, version: int) -> bool:
        """A slot is free, and the free list holds what `admit(seq, version)` would take."""
        if not self._free_slots:
            return False
        if not self.budget.num_pages:
            return True
        return self._takes(seq, self._lookup(seq, version)[1]) <= len(self._free)

    def admit(self, seq: Sequence, version: int) -> None:
        """Give `seq` a slot and its pages: the cached pages of its prefix (shared), then new ones; its
        new complete prompt blocks are registered (owed until `confirm`). `version`: the sequence's own."""
        if not self.can_admit(seq, version):
            raise CacheFull(f"admit: sequence {seq.seq_id} does not fit ({len(self._free_slots)} free slots, "
                            f"{len(self._free)} free pages)")
        keys, hits = self._lookup(seq, version)
        slot = self._free_slots.pop()
        pages = []
        for p in hits:
            if not self._ref[p]:
                del self._free[p]
            self._ref[p] += 1
            pages.append(p)
        pages += [self._take() for _ in range(self.budget.pages_for(seq) - len(hits))]
        for j in range(len(hits), len(keys)):
            if keys[j] not in self._page_of:
                self._register(keys[j], pages[j], version)
        seq.slot, seq.block_table = slot, pages
        seq.num_cached_tokens = len(hits) * self.budget.page_tokens
        self._held[seq.seq_id] = seq
        if self.tables is not None:
            self.tables[slot, :len(pages)] = pages
        if self.sharing:
            self.num_queried_tokens += len(seq.prompt_ids)
            self.num_hit_tokens += seq.num_cached_tokens

    def _register(self, key: bytes, page: int, version: int) -> None:
        self._page_of[key] = page
        self._key_of[page] = (key, version)
        self._owed.append(page)

    def _take(self) -> int:
        """The free list's head (an unused page, else the least recently released cached one: evicted)."""
        if not self._free:
            raise CacheFull("KV cache full: no free page")
        page, _ = self._free.popitem(last=False)
        if page in self._key_of:
            self._uncache(page)
            self.num_evicted += 1
        self._ref[page] = 1
        return page

    def _uncache(self, page: int) -> None:
        key, _ = self._key_of.pop(page)
        if self._page_of.get(key) == page:
            del self._page_of[key]

    # ------------------------------------------------------------------ growth (optimistic admission)
    def deficit(self, seqs: Iterable[Sequence]) -> int:
        """Pages the next forward of these (running) sequences lacks, beyond the free list (0: it can run)."""
        need = sum(max(0, self.budget.pages_for(s) - len(s.block_table)) for s in seqs)
        return max(0, need - len(self._free))

    def grow(self, seq: Sequence) -> None:
        """Give a running sequence the pages up to its next forward's block end (CacheFull if not free)."""
        more = self.budget.pages_for(seq) - len(seq.block_table)
        if more <= 0:
            return
        if more > len(self._free):
            raise CacheFull(f"grow: sequence {seq.seq_id} needs {more} pages, {len(self._free)} free")
        first = len(seq.block_table)
        new = [self._take() for _ in range(more)]
        seq.block_table += new
        if self.tables is not None and seq.slot is not None:
            self.tables[seq.slot, first:first + more] = new

    # ------------------------------------------------------------------ release
    def release(self, seq: Sequence) -> None:
        """Its pages and slot back (once): a page nobody else holds goes on the free list -- at its tail if
        it caches a block of the current version (evicted last), else at its head, uncached."""
        if self._held.pop(seq.seq_id, None) is None:
            return
        for page in reversed(seq.block_table):  # a prefix's first blocks are evicted last
            self._ref[page] -= 1
            if self._ref[page]:
                continue
            self._free[page] = None
            entry = self._key_of.get(page)
            if entry is None or entry[1] < self.version:
                if entry is not None:
                    self._uncache(page)
                self._free.move_to_end(page, last=False)
        if self.tables is not None and seq.slot is not None:
            self.tables[seq.slot] = 0
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
        seq.block_table, seq.num_cached_tokens = [], 0  # seq.slot stays: runners read it to drop their state

    def confirm(self) -> None:
        """The step that writes this step's newly registered pages ran: they serve any later sequence."""
        self._owed.clear()

    def forget_owed(self) -> None:
        """The step failed before writing them: this step's registered pages are not cached."""
        for page in self._owed:
            if page in self._key_of:
                self._uncache(page)
        self._owed.clear()

    def retire(self, version: int) -> int:
        """A newer weight version is served: drop every free cached page of an older one (to the free list's
        head); returns how many. Pages still held by older sequences are dropped when released."""
        if version <= self.version:
            return 0
        self.version = version
        old = [p for p, (_, v) in self._key_of.items() if v < version and not self._ref[p]]
        for page in old:
            self._uncache(page)
            self._free.move_to_end(page, last=False)
        return len(old)
