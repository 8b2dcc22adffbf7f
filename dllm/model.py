"""SDARForCausalLM: a Qwen3 transformer with block-causal attention (SDAR / TraDo).

Parameter names match SDAR checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...),
so Hugging Face folders load without conversion (see dllm.weights).

    model = SDARForCausalLM(cfg)
    logits = model(ids, pos)                                   # dense block-causal forward
    logits = model(ids, pos, cache=cache, slots=slots)         # KV-cache decode (dllm.kv_cache, dllm.decoding)
    logits = model.forward_train(noisy, clean, pos, valid)     # noisy-copy + clean-copy layout
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm.attention import MaskSpec, attend
from dllm.config import SDARConfig
from dllm.kv_cache import CacheView, KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """pos: [B, L] -> cos, sin: [B, 1, L, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    freqs = pos.float()[..., None] * inv_freq  # [B, L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: SDARConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, spec: MaskSpec, cache: CacheView | None):
        B, L, _ = x.shape  # x: [B, L, hidden]
        q = self.q_norm(self.q_proj(x).view(B, L, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, L, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # q: [B, H, L, D], k/v: [B, Hkv, L, D]
        if cache is not None:  # write this forward's K/V into the pages, attend over [0, kv_len)
            k, v = cache.update(self.layer_idx, k, v)  # [B, Hkv, kv_len, D]
        out = attend(q, k, v, spec)  # [B, H, L, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: SDARConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: SDARConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, spec, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, spec, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class SDARModel(nn.Module):
    def __init__(self, cfg: SDARConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SDARForCausalLM(nn.Module):
    def __init__(self, cfg: SDARConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = SDARModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def hidden_states(self, ids, spec: MaskSpec, cache: CacheView | None = None) -> torch.Tensor:
        """ids: [B, L] -> final normed hidden states [B, L, hidden] (spec's mask built once, used by all layers)."""
        x = self.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(spec.q_pos, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, spec, cache, use_reentrant=False)
            else:
                x = layer(x, cos, sin, spec, cache)
        return self.model.norm(x)

    def forward(self, input_ids, position_ids=None, cache: KVCache | None = None, slots=None,
                k_valid=None, kv_len: int | None = None, write_mask=None, num_logits: int | None = None,
                num_logit_rows: int | None = None, clean_ids=None, valid=None,
                output: str = "logits") -> torch.Tensor:
        """Block-causal forward. input_ids/position_ids: [B, L] -> logits [B, L, V].

        With `cache` and `slots` ([B] cache rows), the tokens' K/V are written into the
        cache at their positions (tokens where write_mask [B, L] is False write nowhere
        that is read) and attention runs over cache positions [0, kv_len) (kv_len: max
        position + 1; pass it to spare a device sync). `num_logits` / `num_logit_rows`: logits
        of the last n positions / rows only (0 positions: a forward that only fills the cache).
        With `clean_ids` and `valid` ([B, L]) it is `forward_train(input_ids, clean_ids, ...)`
        (so a DeepSpeed engine wrapping the model can run the training layout); with
        output="hidden" it returns the noisy copy's hidden states [B, L, hidden] instead
        (the trainer then applies `lm_head` to the scored tokens only, in chunks).
        """
        B, L = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        if clean_ids is not None:
            if output == "hidden":
                return self.hidden_train(input_ids, clean_ids, position_ids, valid)
            return self.forward_train(input_ids, clean_ids, position_ids, valid)
        bs = self.config.block_size
        if cache is None:
            spec = MaskSpec(position_ids, position_ids, bs, k_valid=k_valid)
            return self.lm_head(self.hidden_states(input_ids, spec))
        if kv_len is None:
            kv_len = int(position_ids.max()) + 1
        k_pos = torch.arange(kv_len, device=input_ids.device).expand(B, kv_len)
        # keys beyond each row's own last position are stale cache entries
        k_valid = k_pos <= position_ids.max(dim=1, keepdim=True).values
        spec = MaskSpec(position_ids, k_pos, bs, k_valid=k_valid, backend="sdpa")  # decode: SDPA (dllm.attention)
        hidden = self.hidden_states(input_ids, spec, cache.view(slots, position_ids, kv_len, write_mask))
        return self.lm_head(hidden[B - (num_logit_rows if num_logit_rows is not None else B):,
                                   L - (num_logits if num_logits is not None else L):])

    def train_spec(self, position_ids, valid) -> MaskSpec:
        B, L = position_ids.shape
        pos2 = torch.cat([position_ids, position_ids], dim=1)  # [B, 2L]
        noisy = torch.zeros(B, 2 * L, dtype=torch.bool, device=position_ids.device)
        noisy[:, :L] = True
        valid2 = torch.cat([valid, valid], dim=1)
        return MaskSpec(pos2, pos2, self.config.block_size, q_noisy=noisy, k_noisy=noisy, k_valid=valid2)

    def hidden_train(self, noisy_ids, clean_ids, position_ids, valid) -> torch.Tensor:
        """Noisy copy + clean copy layout -> hidden states of the noisy copy [B, L, hidden]."""
        L = noisy_ids.shape[1]
        spec = self.train_spec(position_ids, valid)
        return self.hidden_states(torch.cat([noisy_ids, clean_ids], dim=1), spec)[:, :L]

    def forward_train(self, noisy_ids, clean_ids, position_ids, valid, return_hidden: bool = False):
        """Noisy copy + clean copy layout. All inputs [B, L]; returns logits of the noisy copy
        [B, L, V] (and its hidden states [B, L, hidden] with return_hidden)."""
        hidden = self.hidden_train(noisy_ids, clean_ids, position_ids, valid)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits
