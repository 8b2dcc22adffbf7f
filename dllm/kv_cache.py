"""Block-paged KV cache: pages of `block_size` tokens shared by every sequence, a page table per slot.

    cache = KVCache(cfg, num_slots=16, max_len=8192, device=dev, dtype=dt, num_pages=4096)
    cache.allocate(slot, num_tokens)        # give the slot pages for positions [0, num_tokens) (CacheFull)
    logits = model(ids, pos, cache=cache, slots=slots, kv_len=...)   # writes + reads through the tables
    cache.free(slot)                        # its pages go back to the pool

K and V live in one pool per layer, `cache.kv[layer]`: `[(num_pages + 1) * page_size, 2,
num_kv_heads, head_dim]` (token rows; page p holds rows [p * page_size, (p + 1) * page_size)),
so a layer writes its keys and values with ONE index_copy_ (the model hands it each token's
K|V row as a view of its qkv projection) and reads them with one gather. The layers' pools
are separate tensors, not views of one: under torch.compile a write through a view of a
shared base is functionalised into a copy of the whole base (O(pool) per step); a write into
a tensor of its own stays in place. Page 0 is a scratch page that unallocated table entries
point at (padding writes land there and are
never attended to). A sequence holds only the pages its own length needs, so memory
follows real sequence lengths, not `num_slots x max_len`. With `num_pages=None` every slot
gets its `max_len` pages up front (the simple fixed layout, for direct use of the model).

`KVCache.bytes_per_token(cfg, dtype)` is what one cached token costs (keys + values, all
layers): the number the server sizes the pool from.
"""

from __future__ import annotations

import torch

from dllm.config import SDARConfig


class CacheFull(RuntimeError):
    """No free page left for an allocation."""


class KVCache:
    def __init__(self, cfg: SDARConfig, num_slots: int, max_len: int, device: torch.device | str, dtype: torch.dtype,
                 num_pages: int | None = None) -> None:
        ps = self.page_size = cfg.block_size
        self.num_slots = num_slots
        self.max_pages = -(-max_len // ps)  # pages of one slot's longest sequence
        self.max_len = self.max_pages * ps
        fixed = num_pages is None
        self.num_pages = num_slots * self.max_pages if num_pages is None else int(num_pages)
        shape = ((self.num_pages + 1) * ps, 2, cfg.num_key_value_heads, cfg.head_dim)  # K and V of a token
        self.kv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        # a power of two of columns, the entries past max_pages scratch: the decode step reads keys in
        # buckets of 1, 2, 4, ... pages, whatever max_len (so its results do not depend on max_len)
        self.table_pages = 1 << (self.max_pages - 1).bit_length()
        self.page_table = torch.zeros(num_slots, self.table_pages, dtype=torch.long, device=device)  # 0 = scratch
        self.slot_pages: list[list[int]] = [[] for _ in range(num_slots)]
        self.free_pages = list(range(self.num_pages, 0, -1))
        if fixed:
            for slot in range(num_slots):
                self.allocate(slot, self.max_len)

    @staticmethod
    def bytes_per_token(cfg: SDARConfig, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * item

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, slot: int, num_tokens: int) -> None:
        """Make `slot` hold pages for positions [0, num_tokens) (keeps the pages it has)."""
        pages = self.slot_pages[slot]
        need = self.pages_for(min(num_tokens, self.max_len)) - len(pages)
        if need <= 0:
            return
        if need > len(self.free_pages):
            raise CacheFull(f"KV cache full: {need} pages needed, {len(self.free_pages)} free")
        new = [self.free_pages.pop() for _ in range(need)]
        first = len(pages)
        pages += new
        row = torch.tensor(new, dtype=torch.long).to(self.page_table.device, non_blocking=True)
        self.page_table[slot, first:first + need] = row

    def free(self, slot: int) -> None:
        self.free_pages += reversed(self.slot_pages[slot])
        self.slot_pages[slot] = []
        self.page_table[slot] = 0

    def view(self, slots: torch.Tensor, q_pos: torch.Tensor, kv_len: int | torch.Tensor,
             write_mask: torch.Tensor | None = None) -> CacheView:
        return CacheView(self, slots, q_pos, kv_len, write_mask)


class CacheView:
    """One forward's cache addressing, computed once and used by every layer.

    slots: [N] cache rows, q_pos: [N, L] positions written (where write_mask [N, L], else into
    the scratch page: padding), kv_len: positions [0, kv_len) read (an int, or the key
    positions themselves, a [kv_len] tensor: the static decode step passes its bucket's)."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, q_pos: torch.Tensor, kv_len: int | torch.Tensor,
                 write_mask: torch.Tensor | None = None) -> None:
        ps = cache.page_size
        table = cache.page_table[slots]  # [N, table_pages]
        self.cache = cache
        write = table.gather(1, q_pos // ps) * ps + q_pos % ps  # [N, L]
        if write_mask is not None:
            write = torch.where(write_mask, write, q_pos % ps)  # page 0: scratch
        self.write_idx = write.flatten()  # [N * L]
        k_pos = torch.arange(kv_len, device=q_pos.device) if isinstance(kv_len, int) else kv_len
        self.read_idx = table[:, k_pos // ps] * ps + k_pos % ps  # [N, kv_len]

    def update(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv: [N, L, 2 Hkv, D] this forward's keys then values per token -> all cached keys and
        values [N, Hkv, kv_len, D] each (views, after writing): one write and one read per layer."""
        flat = self.cache.kv[layer]  # [(P + 1) * page_size, 2, Hkv, D]
        new = kv.view(-1, *flat.shape[1:])  # [N * L, 2, Hkv, D]
        flat.index_copy_(0, self.write_idx, new if new.dtype == flat.dtype else new.to(flat.dtype))
        got = flat[self.read_idx]  # [N, kv_len, 2, Hkv, D]
        if got.dtype != kv.dtype:
            got = got.to(kv.dtype)
        got = got.permute(2, 0, 3, 1, 4)  # [2, N, Hkv, kv_len, D]
        return got[0], got[1]
