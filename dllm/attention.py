"""Block-diffusion attention: one mask rule, two backends (SDPA on CPU, FlexAttention on CUDA).

Every query and key token carries its absolute position, whether it is in the
"noisy" copy (a block being denoised) and whether it is valid (not padding):

- a clean query in block b sees clean keys of blocks <= b (block-causal);
- a noisy query in block b sees clean keys of blocks < b and noisy keys of block b;
- nobody sees padding. With block_size 1 and no noisy tokens this is causal attention.

The KV-cache decode path, the dense block-causal forward and the SFT/RL training
layout (noisy copy + clean copy) are all instances of this rule.
The mask (dense: additive float for SDPA; a BlockMask for FlexAttention) is built once per forward
and cached on the MaskSpec that every layer receives. FlexAttention is compiled once with
dynamic shapes, so one kernel serves every batch size and length (it also runs on CPU).
Backend: env DLRL_ATTN=sdpa|flex overrides the automatic choice (flex on CUDA for heads of 16+ dims,
which torch's flex kernels need, except fp32 with grouped-query heads; else SDPA) of the dense
and training forwards; KV-cache decode forwards always use SDPA (`MaskSpec.backend`): one
fused kernel over the bucketed keys with the step's dense mask, no compilation per shape.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class MaskSpec:
    q_pos: torch.Tensor  # [B, Lq] absolute positions
    k_pos: torch.Tensor  # [B, Lk]
    block_size: int
    q_noisy: torch.Tensor | None = None  # [B, Lq] bool
    k_noisy: torch.Tensor | None = None  # [B, Lk] bool
    k_valid: torch.Tensor | None = None  # [B, Lk] bool
    backend: str | None = None  # "sdpa" | "flex": this forward's kernel (None: DLRL_ATTN, else by device);
    # "flash": the decode step's flash-attn kernel over the cache (`attend_cached`, called by the model)

    def dense(self) -> torch.Tensor:
        """Boolean mask [B, 1, Lq, Lk], True = may attend (built once, shared by all layers)."""
        cached = self.__dict__.get("_dense")
        if cached is not None:
            return cached
        qb = (self.q_pos // self.block_size)[:, :, None]
        kb = (self.k_pos // self.block_size)[:, None, :]
        if self.q_noisy is None:
            allowed = kb <= qb
        else:
            assert self.k_noisy is not None, "MaskSpec: q_noisy needs k_noisy (the noisy copy is in queries and keys)"
            qn = self.q_noisy[:, :, None]
            kn = self.k_noisy[:, None, :]
            allowed = torch.where(qn, torch.where(kn, kb == qb, kb < qb), (~kn) & (kb <= qb))
        if self.k_valid is not None:
            allowed = allowed & self.k_valid[:, None, :]
        # a fully masked row (padding query) would give NaN: let it see itself-position 0 harmlessly
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        self.__dict__["_dense"] = allowed[:, None]
        return self.__dict__["_dense"]

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense mask as SDPA's float form [B, 1, Lq, Lk] (0 may attend, -inf not), built once per
        forward: a bool mask costs SDPA a conversion (six aten ops) in every layer. Same values as
        SDPA's own conversion, so the same results."""
        cached = self.__dict__.get("_additive")
        if cached is None or cached.dtype != dtype:
            cached = torch.zeros((), dtype=dtype, device=self.q_pos.device).masked_fill(~self.dense(), float("-inf"))
            self.__dict__["_additive"] = cached
        return cached


FLEX_MIN_HEAD_DIM = 16  # torch's flex kernels refuse smaller heads ("NYI: embedding dimension ... at least 16")


def _backend(device: torch.device, head_dim: int, dtype: torch.dtype | None = None, gqa: bool = False) -> str:
    """DLRL_ATTN if set; else flex on CUDA for heads of 16+ dims, except fp32 with grouped-query heads
    (inductor's flex lowering found no kernel for it on an H200, torch 2.11: NoValidChoicesError); SDPA."""
    forced = os.environ.get("DLRL_ATTN", "").lower()
    if forced in ("sdpa", "flex"):
        return forced
    if dtype == torch.float32 and gqa:
        return "sdpa"
    return "flex" if device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM else "sdpa"


def prepare(spec: MaskSpec, batch: int, q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device,
            head_dim: int, gqa: bool) -> None:
    """Build the forward's mask (SDPA's additive one or flex's BlockMask) before the first layer runs, so
    that every layer -- compiled ones included -- finds it built (one graph for all layers)."""
    if (spec.backend or _backend(device, head_dim, dtype, gqa)) == "flex":
        block_mask(spec, batch, q_len, kv_len, device)
    else:
        spec.additive(dtype)


_flex_compiled = None


def _flex_fn() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once with dynamic shapes: one kernel for every batch and length
    (a static-shape compile would recompile per length and, past torch's recompile limit,
    silently fall back to the unfused O(L^2) path)."""
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    return _flex_compiled


def block_mask(spec: MaskSpec, batch: int, q_len: int, kv_len: int, device: torch.device | str) -> object:
    """The FlexAttention BlockMask of `spec` (built once per forward, shared by all layers)."""
    cached = spec.__dict__.get("_block_mask")
    if cached is not None:
        return cached
    from torch.nn.attention.flex_attention import create_block_mask

    # block ids precomputed: mask_mod captures only tensors (a captured Python int becomes a
    # symbolic size under dynamic shapes, which inductor's CPU flex template miscompiles)
    qblk = (spec.q_pos // spec.block_size).contiguous()  # [B, Lq]
    kblk = (spec.k_pos // spec.block_size).contiguous()  # [B, Lk]
    qn = spec.q_noisy.contiguous() if spec.q_noisy is not None else torch.zeros_like(qblk, dtype=torch.bool)
    kn = spec.k_noisy.contiguous() if spec.k_noisy is not None else torch.zeros_like(kblk, dtype=torch.bool)
    kv = spec.k_valid.contiguous() if spec.k_valid is not None else torch.ones_like(kblk, dtype=torch.bool)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        qb, kb = qblk[b, qi], kblk[b, ki]
        noisy_q = qn[b, qi]
        noisy_k = kn[b, ki]
        seen_by_noisy = (noisy_k & (kb == qb)) | (~noisy_k & (kb < qb))
        seen_by_clean = ~noisy_k & (kb <= qb)
        return kv[b, ki] & ((noisy_q & seen_by_noisy) | (~noisy_q & seen_by_clean))

    spec.__dict__["_block_mask"] = create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)
    return spec.__dict__["_block_mask"]


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    mask = block_mask(spec, q.shape[0], q.shape[2], k.shape[2], q.device)
    return _flex_fn()(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """q: [B, H, Lq, D], k/v: [B, Hkv, Lk, D] -> [B, H, Lq, D]."""
    if (spec.backend or _backend(q.device, q.shape[-1], q.dtype, k.shape[1] != q.shape[1])) == "flex":
        return _flex(q, k, v, spec)
    # grouped-query attention without materialising repeated K/V (same result, several times faster)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=spec.additive(q.dtype), enable_gqa=k.shape[1] != q.shape[1])


# ----------------------------------------------------------------------------- decode over the KV cache

DECODE_BACKENDS = ("auto", "sdpa", "flash")


def flash_attn_importable() -> bool:
    """Whether flash-attn (`flash_attn_with_kvcache`) can be imported here."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def decode_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The decode step's attention kernel: "flash" (flash-attn's `flash_attn_with_kvcache`: CUDA, fp16 /
    bf16, head_dim a multiple of 8 up to 256) where asked or, for "auto", where it can run; else "sdpa"."""
    if requested not in DECODE_BACKENDS:
        raise ValueError(f"attention: unknown decode backend {requested!r} (known: {', '.join(DECODE_BACKENDS)})")
    fits = (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256)
    if requested == "flash" and not (fits and flash_attn_importable()):
        raise ValueError("attention: flash needs CUDA, fp16/bf16 weights, head_dim % 8 == 0 (<= 256) and flash-attn")
    if requested == "auto":
        return "flash" if fits and flash_attn_importable() else "sdpa"
    return requested


@torch.library.custom_op("dlrl::flash_decode", mutates_args=())
def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """q: [N, L, H, D] (a block of L queries per row), k/v: [N, KV, Hkv, D] (keys in position order), seqlens:
    [N] int32 -> [N, L, H, D]: each row's queries over its keys [0, seqlens) with no causal mask (the block
    sees the cache and all of itself). flash-attn's `flash_attn_with_kvcache` over the keys the step
    gathered from its pages: its own `block_table` needs pages of 256k tokens (flash-attn 2), ours hold one
    block. A custom op, so torch.compile (fullgraph) keeps it whole."""
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=False).contiguous()


@flash_decode.register_fake
def _flash_decode_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """`flash_decode`'s definition with SDPA (any device and dtype): same shapes, same rule."""
    keys = torch.arange(k.shape[1], device=k.device)
    allowed = (keys[None, :] < seqlens[:, None].long())[:, None, None, :]  # [N, 1, 1, KV]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
                                         enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """The decode step's attention with `spec.backend == "flash"`: q [N, L, H, D], k/v [N, KV, Hkv, D] ->
    [N, L, H, D]; keys [0, block end) of each row (its last query position + 1), built once per forward."""
    seqlens = spec.__dict__.get("_seqlens")
    if seqlens is None:
        seqlens = spec.__dict__["_seqlens"] = (spec.q_pos[:, -1] + 1).to(torch.int32)
    return flash_decode(q, k, v, seqlens)
