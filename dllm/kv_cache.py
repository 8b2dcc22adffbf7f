"""Block-paged KV cache: the K/V pools, pages of `block_size` tokens; a forward addresses them by page tables.

    cache = KVCache(cfg, num_pages=4096, device=dev, dtype=dt)
    table = ...                              # [N, P] page ids per row (dllm.block_manager gives them out)
    logits = model(ids, pos, cache=cache, page_table=table, kv_len=...)   # writes + reads through the tables
    table = cache.fixed_table(num_rows=2, max_len=64)   # direct use of the model: row r owns its own pages

The cache is storage only: which sequence holds which page is the block manager's
(dllm.block_manager, owned by the scheduler); a forward gets each row's page table as an
input. K and V live in one pool per layer, `cache.kv[layer]`: `[(num_pages + 1) * page_size, 2,
num_kv_heads, head_dim]` (token rows; page p holds rows [p * page_size, (p + 1) * page_size)),
so a layer writes its keys and values with ONE index_copy_ (the model hands it each token's
K|V row as a view of its qkv projection) and reads them with one gather. The layers' pools
are separate tensors, not views of one: under torch.compile a write through a view of a
shared base is functionalised into a copy of the whole base (O(pool) per step); a write into
a tensor of its own stays in place. Page 0 is a scratch page: table entries past a row's
pages point at it, padding writes land there and are never attended to. Several rows may
read the same page (a shared prompt block); within one forward every layer writes all rows'
K/V before any row reads, so a row may read a page another row of the same forward writes.

`KVCache.bytes_per_token(cfg, dtype)` is what one cached token costs (keys + values, all
layers): the number the server sizes the pool from.
"""

from __future__ import annotations

import torch

from dllm.config import SDARConfig


class KVCache:
    def __init__(self, cfg: SDARConfig, num_pages: int, device: torch.device | str, dtype: torch.dtype) -> None:
        ps = self.page_size = cfg.block_size
        self.num_pages = int(num_pages)
        shape = ((self.num_pages + 1) * ps, 2, cfg.num_key_value_heads, cfg.head_dim)  # K and V of a token
        self.kv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]

    @staticmethod
    def bytes_per_token(cfg: SDARConfig, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * item

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def fixed_table(self, num_rows: int, max_len: int) -> torch.Tensor:
        """[num_rows, pages of max_len]: row r owns pages 1 + r n .. (r + 1) n -- the fixed layout of direct
        use of the model (tests, micro-benchmarks), with no scheduler to hand pages out."""
        n = self.pages_for(max_len)
        if num_rows * n > self.num_pages:
            raise ValueError(f"fixed_table: {num_rows} rows of {n} pages need {num_rows * n}, the pool has "
                             f"{self.num_pages}")
        return 1 + torch.arange(num_rows * n, device=self.kv[0].device).view(num_rows, n)

    def view(self, page_table: torch.Tensor, q_pos: torch.Tensor, kv_len: int | torch.Tensor,
             write_mask: torch.Tensor | None = None) -> CacheView:
        return CacheView(self, page_table, q_pos, kv_len, write_mask)


class CacheView:
    """One forward's cache addressing, computed once and used by every layer.

    page_table: [N, P] each row's pages, q_pos: [N, L] positions written (where write_mask [N, L],
    else into the scratch page: padding; positions < P * page_size), kv_len: positions [0, kv_len)
    read (an int, or the key positions themselves, a [kv_len] tensor: the decode step passes its
    bucket's)."""

    def __init__(self, cache: KVCache, page_table: torch.Tensor, q_pos: torch.Tensor, kv_len: int | torch.Tensor,
                 write_mask: torch.Tensor | None = None) -> None:
        ps = cache.page_size
        self.cache = cache
        write = page_table.gather(1, q_pos // ps) * ps + q_pos % ps  # [N, L]
        if write_mask is not None:
            write = torch.where(write_mask, write, q_pos % ps)  # page 0: scratch
        self.write_idx = write.flatten()  # [N * L]
        k_pos = torch.arange(kv_len, device=q_pos.device) if isinstance(kv_len, int) else kv_len
        self.read_idx = page_table[:, k_pos // ps] * ps + k_pos % ps  # [N, kv_len]

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
