"""SDAR for transformers (`trust_remote_code`): a Qwen3 transformer with block-causal
attention (blocks of `config.block_size` positions see themselves and earlier blocks).
Shipped by dlrl into exports; parameter names match SDAR checkpoints.

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    logits = model(input_ids).logits        # [B, L, V], the dense block-causal forward

`attention_mask` may be a [B, L] padding mask (1 = token) or a ready [B, 1, L, L] mask
(bool: True = visible, or additive float). No KV cache: decoding is block diffusion, which
dlrl serves (`dlrl serve`); this file is for loading, scoring and fine-tuning elsewhere.
"""

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_sdar import SDARConfig

_IS_V5 = int(transformers.__version__.split(".")[0]) >= 5


class SDARRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(position_ids, head_dim, theta, dtype):
    """position_ids [B, L] -> cos, sin [B, 1, L, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
                                / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def block_causal_mask(position_ids, block_size, dtype, padding=None):
    """[B, L] positions (+ optional [B, L] padding mask) -> additive [B, 1, L, L] mask (0 = visible)."""
    blocks = position_ids // block_size
    visible = blocks[:, None, :] <= blocks[:, :, None]  # key block <= query block
    if padding is not None:
        visible = visible & padding.bool()[:, None, :]
    mask = torch.zeros(visible.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]  # a padded row stays finite


class SDARAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, bias = config.head_dim, config.attention_bias
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = SDARRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = SDARRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, L, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, L, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class SDARMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SDARDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = SDARAttention(config, layer_idx)
        self.mlp = SDARMLP(config)
        self.input_layernorm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class SDARPreTrainedModel(PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["SDARDecoderLayer"]
    # SDAR configs name `attn_implementation: flex_attention`; this file always runs torch SDPA
    # with the block-causal mask, whichever kernel the config names (same maths)
    _supports_sdpa = True
    _supports_flex_attn = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, std)
            bias = getattr(module, "bias", None)
            if bias is not None:
                bias.data.zero_()
        elif isinstance(module, SDARRMSNorm):
            module.weight.data.fill_(1.0)


class SDARModel(SDARPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SDARDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, L = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(L, device=x.device).expand(B, L)
        if attention_mask is None or attention_mask.dim() == 2:
            mask = block_causal_mask(position_ids, self.config.block_size, x.dtype, attention_mask)
        else:
            mask = attention_mask.to(x.dtype) if attention_mask.is_floating_point() else attention_mask.bool()
        cos, sin = rotary(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x))


class SDARForCausalLM(SDARPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"} if _IS_V5 else ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = SDARModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                **kwargs):
        hidden = self.model(input_ids, attention_mask, position_ids, inputs_embeds).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # masked-token cross entropy: labels -100 are ignored
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


__all__ = ["SDARForCausalLM", "SDARModel", "SDARPreTrainedModel"]
