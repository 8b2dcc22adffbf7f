"""FullAttentionLM: the bidirectional transformer of LLaDA (OLMo layout) and Dream (Qwen2 layout).

    model = FullAttentionLM(cfg)                        # cfg: dllm.full.config.FullAttentionConfig
    logits = model(ids, pos)                            # [N, L, V]: position i's logits predict token i
    logits = model(ids, pos, valid=valid)               # padded rows: invalid keys are seen by nobody
    hidden = model(ids, pos, valid=valid, output="hidden")   # [N, L, D]; model.lm_head(hidden) = logits
    hidden, kv = model.hidden_states(ids, pos, valid, keep_kv=True)   # + every layer's K/V (prefix cache)
    dict(model.hf_named_tensors())                      # {official name: parameter}

Parameters carry the official names, so checkpoints, exports, weight sync and digests use them as they
are (no fused tensors here): LLaDA `model.transformer.wte.weight`,
`model.transformer.blocks.N.{attn_norm,q_proj,k_proj,v_proj,attn_out,ff_norm,ff_proj,up_proj,ff_out}.weight`,
`model.transformer.ln_f.weight`, `model.transformer.ff_out.weight` (absent with `weight_tying`: the
embedding is the output layer); Dream `model.embed_tokens.weight`, `model.layers.N.self_attn.{q,k,v}_proj`
(weight and bias), `o_proj.weight`, `mlp.{gate,up,down}_proj.weight`, `input_layernorm.weight`,
`post_attention_layernorm.weight`, `model.norm.weight`, `lm_head.weight`.

Every position attends to every valid position (no causal mask). Dream's logits are shifted by one as
in its reference code (`cat([logits[:, :1], logits[:, :-1]])`: position i is predicted from the hidden
state at i - 1); this model shifts the hidden states instead, so `forward` and `output="hidden"` already
line up with the tokens (row i predicts token i) for both families. The blocks reuse dllm.model's
RMSNorm (fp32 normalisation, HF rounding), rotary embedding, Linear and dllm.attention.attend (SDPA on
CPU, FlexAttention on CUDA) with a mask that lets every query see every valid key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dllm.attention import MaskSpec, attend
from dllm.full.config import FullAttentionConfig
from dllm.model import Linear, Placed, RMSNorm, apply_rope, rope_cos_sin, trunk

ALL_ONE_BLOCK = 1 << 62  # MaskSpec's block size for full attention: every position is in block 0
KV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values [N, Hkv, L, D] (rope applied)


def full_spec(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None,
              backend: str | None = None) -> MaskSpec:
    """Bidirectional attention as a MaskSpec: every query sees every valid key (`backend`: the kernel, None =
    by device)."""
    return MaskSpec(q_pos, k_pos, ALL_ONE_BLOCK, k_valid=k_valid, backend=backend)


class SelfAttention(nn.Module):
    """q/k/v projections, rotary embedding, bidirectional attention, output projection. The projection
    modules are attributes of `owner` (their official place: the LLaDA block itself, Dream's self_attn)."""

    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.rope_fp32 = cfg.rope_full_precision

    def attend(self, q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module, o_proj: nn.Module, x: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, spec: MaskSpec, past: KV | None,
               keep: list[KV] | None) -> torch.Tensor:
        B, L = cos.shape[:2]  # x: [B * L, hidden]
        q = q_proj(x).view(B, L, self.num_heads, self.head_dim)
        k = k_proj(x).view(B, L, self.num_kv_heads, self.head_dim)
        v = v_proj(x).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope_fp32 and q.dtype != torch.float32:  # LLaDA's rope_full_precision: rotate in fp32
            q = apply_rope(q.float(), cos, sin).to(x.dtype)
            k = apply_rope(k.float(), cos, sin).to(x.dtype)
        else:
            q, k = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        k = k.transpose(1, 2)  # [B, Hkv, L, D]
        if keep is not None:
            keep.append((k, v))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        out = attend(q.transpose(1, 2), k, v, spec).transpose(1, 2).reshape(B * L, -1)
        return o_proj(out)


def swiglu(gate: nn.Module, up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return down(F.silu(gate(x)) * up(x))


class LLaDABlock(nn.Module):
    """One OLMo `LLaDALlamaBlock`: attn_norm, q/k/v_proj, attn_out, ff_norm, ff_proj (gate), up_proj, ff_out."""

    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = Linear(h, cfg.num_attention_heads * d, bias=bias)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.attn_out = Linear(cfg.num_attention_heads * d, h, bias=False)
        self.ff_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.ff_proj = Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(h, cfg.intermediate_size, bias=False)
        self.ff_out = Linear(cfg.intermediate_size, h, bias=False)
        self.attn = SelfAttention(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: MaskSpec,
                past: KV | None = None, keep: list[KV] | None = None) -> torch.Tensor:
        x = x + self.attn.attend(self.q_proj, self.k_proj, self.v_proj, self.attn_out, self.attn_norm(x),
                                 cos, sin, spec, past, keep)
        return x + swiglu(self.ff_proj, self.up_proj, self.ff_out, self.ff_norm(x))


class DreamAttention(nn.Module):
    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_attention_heads * d, bias=True)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, bias=True)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, bias=True)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, bias=False)
        self.attn = SelfAttention(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: MaskSpec,
                past: KV | None, keep: list[KV] | None) -> torch.Tensor:
        return self.attn.attend(self.q_proj, self.k_proj, self.v_proj, self.o_proj, x, cos, sin, spec, past, keep)


class DreamMLP(nn.Module):
    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(self.gate_proj, self.up_proj, self.down_proj, x)


class DreamLayer(nn.Module):
    """One Qwen2 decoder layer (Dream): input_layernorm, self_attn, post_attention_layernorm, mlp."""

    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        self.self_attn = DreamAttention(cfg)
        self.mlp = DreamMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: MaskSpec,
                past: KV | None = None, keep: list[KV] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, spec, past, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class LLaDATransformer(nn.Module):
    """`model.transformer`: wte, blocks, ln_f and (untied) ff_out, the OLMo names."""

    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        self.wte, self.blocks, self.ln_f = trunk(cfg, lambda _: LLaDABlock(cfg))
        if not cfg.tie_word_embeddings:
            self.ff_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class LLaDABody(nn.Module):
    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        self.transformer = LLaDATransformer(cfg)


class DreamBody(nn.Module):
    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        self.embed_tokens, self.layers, self.norm = trunk(cfg, lambda _: DreamLayer(cfg))


class TiedHead(nn.Module):
    """The output layer of a weight-tied model: logits = hidden @ embedding.T (holds no parameter of its own)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.__dict__["embedding"] = embedding  # not a submodule: the weight is registered once, by the body

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__["embedding"].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FullAttentionLM(Placed, nn.Module):
    """LLaDA or Dream (config.family), bidirectional; see the module docstring."""

    attention = "full"  # SDARForCausalLM's is "block_causal"

    def __init__(self, cfg: FullAttentionConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.family = cfg.family
        self.gradient_checkpointing = False
        self.model: LLaDABody | DreamBody
        if cfg.family == "llada":
            self.model = LLaDABody(cfg)
            t = self.model.transformer
            self.layers: nn.ModuleList = t.blocks
            self.embed, self.final_norm = t.wte, t.ln_f
            head: nn.Module = TiedHead(t.wte) if cfg.tie_word_embeddings else t.ff_out
        else:
            self.model = DreamBody(cfg)
            self.layers, self.embed, self.final_norm = self.model.layers, self.model.embed_tokens, self.model.norm
            if cfg.tie_word_embeddings:
                head = TiedHead(self.model.embed_tokens)
            else:
                self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                head = self.lm_head
        self.__dict__["_head"] = head  # the output layer, wherever its official name puts it
        for name in ("layers", "embed", "final_norm"):  # aliases of registered modules: not registered twice
            self.__dict__[name] = self._modules.pop(name)
        self.init_weights()

    @property
    def head(self) -> nn.Module:
        """The output layer (LLaDA: model.transformer.ff_out or the tied wte; Dream: lm_head)."""
        return self.__dict__["_head"]

    def __getattr__(self, name: str) -> torch.Tensor | nn.Module:
        if name == "lm_head" and "_head" in self.__dict__ and "lm_head" not in self._modules:
            return self.__dict__["_head"]  # LLaDA has no `lm_head` module: the head under its official name
        return super().__getattr__(name)

    def init_weights(self, std: float = 0.02) -> None:
        """N(0, std) linear and embedding weights, zero biases, ones for the norms (module order)."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=std)
                    if (bias := getattr(m, "bias", None)) is not None:
                        nn.init.zeros_(bias)
                elif isinstance(m, RMSNorm):
                    nn.init.ones_(m.weight)

    def compile_layers(self, **options: Any) -> None:
        """torch.compile every layer in place (dynamic shapes), as SDARForCausalLM.compile_layers."""
        for layer in self.layers:
            layer.compile(**{"dynamic": True, **options})

    def hf_layout(self, remove_duplicate: bool = True) -> list[tuple[str, nn.Parameter, list[tuple[str, int, int]] | None]]:
        """[(official name, parameter, None)]: no fused parameters (SDARForCausalLM.hf_layout's shape)."""
        return [(n, p, None) for n, p in self.named_parameters(remove_duplicate=remove_duplicate)]

    def hf_named_tensors(self, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(official name, parameter) of every weight: what loading, export, weight sync and digests use."""
        yield from self.named_parameters(remove_duplicate=remove_duplicate)

    def placed_weight(self) -> torch.Tensor:  # device / dtype (dllm.model.Placed)
        return self.embed.weight

    def hidden_states(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None = None,
                      past: list[KV] | None = None, past_valid: torch.Tensor | None = None,
                      keep_kv: bool = False, attention: str | None = None) -> tuple[torch.Tensor, list[KV] | None]:
        """ids, pos: [N, L] (valid: [N, L] bool, False = padding nobody sees) -> the final normed hidden
        states [N, L, D] (NOT shifted), and with keep_kv every layer's K/V of these L tokens. `past`: per
        layer K/V [N, Hkv, P, D] of earlier positions (a prefix cache; past_valid [N, P]) that the
        tokens attend to besides themselves. `attention`: "sdpa" | "flex" (None: by device)."""
        N, L = ids.shape
        x = self.embed(ids).view(N * L, -1)
        cos, sin = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta, torch.float32)
        if past is not None:
            P = past[0][0].shape[2]
            pv = past_valid if past_valid is not None else torch.ones(N, P, dtype=torch.bool, device=ids.device)
            kv_valid = torch.cat([pv, valid if valid is not None else torch.ones_like(ids, dtype=torch.bool)], 1)
            k_pos = torch.cat([torch.zeros(N, P, dtype=pos.dtype, device=pos.device), pos], 1)
            spec = full_spec(pos, k_pos, kv_valid, attention)
        else:
            spec = full_spec(pos, pos, valid, attention)
        keep: list[KV] | None = [] if keep_kv else None
        for i, layer in enumerate(self.layers):
            layer_past = past[i] if past is not None else None
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, spec, layer_past, keep, use_reentrant=False)
            else:
                x = layer(x, cos, sin, spec, layer_past, keep)
        return self.final_norm(x).view(N, L, -1), keep

    def shift(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, L, D] -> the ones that predict each position (Dream: row i takes row i - 1,
        row 0 keeps its own, as the reference's logit shift)."""
        if self.config.logit_shift == 0:
            return hidden
        return torch.cat([hidden[:, :1], hidden[:, :-1]], 1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, output: str = "logits") -> torch.Tensor:
        """Bidirectional forward. input_ids/position_ids/valid: [N, L] -> logits [N, L, V] where position i's
        logits predict token i (Dream's shift applied), or with output="hidden" the hidden states that
        `lm_head` turns into them [N, L, D] (the trainer applies the head to scored tokens only)."""
        N, L = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(L, device=input_ids.device).expand(N, L)
        hidden = self.shift(self.hidden_states(input_ids, position_ids, valid)[0])
        return hidden if output == "hidden" else self.head(hidden)
