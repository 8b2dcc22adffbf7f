"""Block-diffusion attention: one mask rule, two backends (SDPA on CPU, FlexAttention on CUDA).

Every query and key token carries its absolute position, whether it is in the
"noisy" copy (a block being denoised) and whether it is valid (not padding):

- a clean query in block b sees clean keys of blocks <= b (block-causal);
- a noisy query in block b sees clean keys of blocks < b and noisy keys of block b;
- nobody sees padding. With block_size 1 and no noisy tokens this is causal attention.

The KV-cache decode path, the dense block-causal forward and the SFT/RL training
layout (noisy copy + clean copy) are all instances of this rule.
Backend: env DLRL_ATTN=sdpa|flex overrides the automatic choice (flex on CUDA).
"""

from __future__ import annotations

import os
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
            qn = self.q_noisy[:, :, None]
            kn = self.k_noisy[:, None, :]
            allowed = torch.where(qn, torch.where(kn, kb == qb, kb < qb), (~kn) & (kb <= qb))
        if self.k_valid is not None:
            allowed = allowed & self.k_valid[:, None, :]
        # a fully masked row (padding query) would give NaN: let it see itself-position 0 harmlessly
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        self.__dict__["_dense"] = allowed[:, None]
        return self.__dict__["_dense"]


def _backend(device: torch.device) -> str:
    forced = os.environ.get("DLRL_ATTN", "").lower()
    if forced in ("sdpa", "flex"):
        return forced
    return "flex" if device.type == "cuda" else "sdpa"


_flex_compiled = None


def _flex(q, k, v, spec: MaskSpec) -> torch.Tensor:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    bs = spec.block_size
    qpos, kpos = spec.q_pos, spec.k_pos
    qn = spec.q_noisy if spec.q_noisy is not None else torch.zeros_like(qpos, dtype=torch.bool)
    kn = spec.k_noisy if spec.k_noisy is not None else torch.zeros_like(kpos, dtype=torch.bool)
    kv = spec.k_valid if spec.k_valid is not None else torch.ones_like(kpos, dtype=torch.bool)

    def mask_mod(b, h, qi, ki):
        qb, kb = qpos[b, qi] // bs, kpos[b, ki] // bs
        noisy_q = qn[b, qi]
        noisy_k = kn[b, ki]
        seen_by_noisy = (noisy_k & (kb == qb)) | (~noisy_k & (kb < qb))
        seen_by_clean = ~noisy_k & (kb <= qb)
        return kv[b, ki] & ((noisy_q & seen_by_noisy) | (~noisy_q & seen_by_clean))

    B, Lq, Lk = q.shape[0], q.shape[2], k.shape[2]
    block_mask = create_block_mask(mask_mod, B, None, Lq, Lk, device=q.device)
    return _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """q: [B, H, Lq, D], k/v: [B, Hkv, Lk, D] -> [B, H, Lq, D]."""
    if _backend(q.device) == "flex":
        return _flex(q, k, v, spec)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=spec.dense())
