"""SDARForCausalLM: a Qwen3 transformer with block-causal attention (SDAR / TraDo).

The projections are fused at load time: `self_attn.qkv_proj` holds q/k/v and `mlp.gate_up_proj`
holds gate/up, stacked by rows (one matmul each). Everything outside sees SDAR checkpoint
names (`model.layers.N.self_attn.q_proj.weight`, ...) through `model.hf_named_tensors()`
(views into the fused parameters), so Hugging Face folders load without conversion and
export, weight sync and digests keep the HF layout (see dllm.weights).

    model = SDARForCausalLM(cfg)
    logits = model(ids, pos)                                   # dense block-causal forward
    logits = model(ids, pos, cache=cache, page_table=table)    # KV-cache forward (dllm.kv_cache, dllm.runner)
    logits = model.forward_train(noisy, clean, pos, valid)     # noisy-copy + clean-copy layout
    dict(model.hf_named_tensors())                             # {HF name: tensor or view}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from dllm.attention import MaskSpec, attend, attend_cached, prepare
from dllm.config import ModelConfig, SDARConfig
from dllm.kv_cache import CacheView, KVCache


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm in few ops: normalise in fp32, cast back, scale (HF's rounding order).

    The mean is a sum scaled by 1/dim (exact for power-of-two widths), and eps is added as a
    0-d tensor (a Python scalar costs aten four extra ops to wrap): 7 aten ops in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._eps: torch.Tensor | None = None  # fp32 0-d tensor on the input's device, made once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps_on(x.device))

    def eps_on(self, device: torch.device) -> torch.Tensor:
        if self._eps is None or self._eps.device != device:
            self._eps = torch.tensor(self.eps, dtype=torch.float32, device=device)
        return self._eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """x: [..., D] -> weight * (x / sqrt(mean(x^2) + eps)) (the norm in fp32, HF's rounding)."""
    return weight * rms_normalize(x, eps)


def rms_normalize(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """x: [..., D] -> x / sqrt(mean(x^2) + eps) in fp32, cast back to x's dtype (no weight)."""
    xf = x if x.dtype == torch.float32 else x.float()
    scale = torch.rsqrt(torch.add(eps, (xf * xf).sum(-1, keepdim=True), alpha=1.0 / x.shape[-1]))
    y = xf * scale
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos: [B, L] -> cos, sin: [B, L, 1, head_dim] (once per forward; sin's first half is
    negated, so that rotate-half is a plain swap of the halves: see apply_rope)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    freqs = pos.float()[..., None] * inv_freq  # [B, L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    sin[..., :head_dim // 2].neg_()
    return emb.cos().to(dtype)[:, :, None], sin.to(dtype)[:, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B, L, H, D] -> x * cos + rotate_half(x) * sin (sin from rope_cos_sin, signs folded in),
    written into `out` when given (no autograd there)."""
    *lead, d = x.shape
    swapped = x.view(*lead, 2, d // 2).flip(-2).view(*lead, d)  # [x2, x1]
    if out is None:
        return torch.addcmul(x * cos, swapped, sin)
    if torch.compiler.is_compiling():  # dynamo takes no non-contiguous out= (compiled, a copy is free)
        return out.copy_(torch.addcmul(x * cos, swapped, sin))
    return torch.addcmul(x * cos, swapped, sin, out=out)


def linear_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, in], weight_t: [in, out] (the weight transposed) -> [N, out] (a 2-D matmul: fewer aten
    ops than F.linear on 3-D input)."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


class Linear(nn.Linear):
    """nn.Linear on 2-D input [N, in] as one mm/addmm (called as a module: ZeRO-3 hooks gather it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_t(x, self.weight_t(), self.bias)

    def weight_t(self) -> torch.Tensor:
        """The weight transposed [in, out], a view. Outside autograd and compilation it is made once
        and reused (two aten ops fewer per matmul) while it still aliases the weight: in-place updates
        (weight sync, load_state_dict) show through it; a replaced weight (`.to()`, `.data = ...`)
        has another address or layout and gets a fresh view at the next inference forward (the old
        storage lives until then). Not for ZeRO-3 parameters (`ds_id`): a kept view would keep
        every gathered weight alive."""
        w = self.weight
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or hasattr(w, "ds_id"):
            return w.transpose(0, 1)  # (one aten op fewer than .t())
        wt = self.__dict__.get("_weight_t")
        if (wt is None or wt.data_ptr() != w.data_ptr() or wt.dtype != w.dtype or wt.device != w.device
                or wt.shape != w.shape[::-1] or wt.stride() != w.stride()[::-1]):
            wt = self.__dict__["_weight_t"] = w.detach().transpose(0, 1)
        return wt


class FusedLinear(Linear):
    """Several Hugging Face projections stacked by output rows, run as one matmul.

    `parts`: [(hf_name, rows)] in row order (e.g. q_proj, k_proj, v_proj). The fused
    parameters are a load-time layout: `SDARForCausalLM.hf_named_tensors()` yields each
    part's rows as a view (same storage), so checkpoints, exports and weight sync keep HF names."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool, fused_name: str) -> None:
        super().__init__(in_features, sum(rows for _, rows in parts), bias=bias)
        self.parts, self.fused_name = parts, fused_name

    def row_slices(self) -> list[tuple[str, int, int]]:
        out, start = [], 0
        for name, rows in self.parts:
            out.append((name, start, start + rows))
            start += rows
        return out

    def fuse_hf_keys(self, state_dict: dict, prefix: str) -> None:
        """In `state_dict`, replace this module's HF tensors (`{prefix}q_proj.weight`, ... with
        prefix its parent's) by the fused one, when all parts are there."""
        for attr in ("weight", "bias"):
            keys = [f"{prefix}{name}.{attr}" for name, _ in self.parts]
            fused = f"{prefix}{self.fused_name}.{attr}"
            if fused not in state_dict and all(k in state_dict for k in keys):
                state_dict[fused] = torch.cat([state_dict.pop(k) for k in keys])


class Attention(nn.Module):
    def __init__(self, cfg: SDARConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        h, bias, d = cfg.hidden_size, cfg.attention_bias, self.head_dim
        self.qkv_proj = FusedLinear(h, [("q_proj", self.num_heads * d), ("k_proj", self.num_kv_heads * d),
                                        ("v_proj", self.num_kv_heads * d)], bias=bias,
                                   fused_name="qkv_proj")
        self.o_proj = Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: MaskSpec,
                cache: CacheView | None) -> torch.Tensor:
        B, L = cos.shape[:2]  # x: [B * L, hidden]; cos/sin: [B, L, 1, D]
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(B, L, -1, self.head_dim)  # [B, L, H + 2 Hkv, D]
        if torch.is_grad_enabled():  # training: out of place
            q, k, v = qkv.split([H, Hkv, Hkv], 2)
            q = apply_rope(self.q_norm(q), cos, sin)  # [B, L, H, D]
            k = apply_rope(self.k_norm(k), cos, sin)  # [B, L, Hkv, D]
            kv = torch.cat([k, v], 2) if cache is not None else None
        else:
            q, kv = self._qk_in_place(qkv, cos, sin)
            if cache is None:
                k, v = kv.split([Hkv, Hkv], 2)
        if cache is not None:  # write this forward's K/V into the pages, attend over [0, kv_len)
            assert kv is not None  # both branches above set it when there is a cache
            k, v = cache.update(self.layer_idx, kv)  # [B, Hkv, kv_len, D] each
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if spec.backend == "flash":  # the decode step on CUDA: flash-attn over the gathered keys
            out = attend_cached(q, k.transpose(1, 2), v.transpose(1, 2), spec)  # [B, L, H, D]
        else:
            out = attend(q.transpose(1, 2), k, v, spec).transpose(1, 2)  # [B, L, H, D]
        out = out.view(B * L, -1) if out.is_contiguous() else out.reshape(B * L, -1)
        return self.o_proj(out)  # [B * L, hidden]

    def _qk_in_place(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference: q_norm / k_norm and rope on the queries and keys together, written over the
        raw ones in qkv [B, L, H + 2 Hkv, D] -> q [B, L, H, D], kv [B, L, 2 Hkv, D] (views of qkv).
        Same values as one by one (every op is per head); each token's K|V row then is the
        cache's [2, Hkv, D] row, written with one index_copy_."""
        H, Hkv = self.num_heads, self.num_kv_heads
        qk = qkv[:, :, :H + Hkv]
        y = rms_normalize(qk, self.q_norm.eps_on(qkv.device))  # q_norm and k_norm share eps
        yq, yk = y.split([H, Hkv], 2)
        yq.mul_(self.q_norm.weight)
        yk.mul_(self.k_norm.weight)
        apply_rope(y, cos, sin, out=qk)
        return qkv.split([H, 2 * Hkv], 2)


class MLP(nn.Module):
    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, [("gate_proj", cfg.intermediate_size),
                                                          ("up_proj", cfg.intermediate_size)], bias=False,
                                          fused_name="gate_up_proj")
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, hidden]
        i = self.intermediate_size
        gate, up = self.gate_up_proj(x).split([i, i], -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: SDARConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: MaskSpec,
                cache: CacheView | None) -> torch.Tensor:  # x: [B * L, hidden] (cos: [B, L, 1, D])
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, spec, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def mark_dynamic_lengths(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: MaskSpec) -> None:
    """Mark the rows and lengths of a forward's layer inputs dynamic (compiled layers: one graph for every
    batch and length, never specialised because a length happens to equal a static size such as head_dim)."""
    mark = torch._dynamo.maybe_mark_dynamic
    mark(x, 0)
    for t in (cos, sin, spec.q_pos, spec.k_pos, spec.q_noisy, spec.k_noisy, spec.k_valid):
        if t is not None:
            mark(t, 0)
            mark(t, 1)
    for name in ("_dense", "_additive"):
        if (m := spec.__dict__.get(name)) is not None:
            for d in (0, 2, 3):
                mark(m, d)


class Placed:
    """`device` and `dtype` of a model: those of its `placed_weight()` (SDAR: lm_head's; dllm.full: the embedding's).
    Every weight of a model lives on one device in one dtype (loading casts them together)."""

    def placed_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.placed_weight().device

    @property
    def dtype(self) -> torch.dtype:
        return self.placed_weight().dtype


def trunk(cfg: ModelConfig, layer: Callable[[int], nn.Module]) -> tuple[nn.Embedding, nn.ModuleList, RMSNorm]:
    """A transformer's trunk from its config, made in this order: the token embedding, `num_hidden_layers` layers
    (`layer(i)`) and the final norm. Each family (SDARModel here, dllm.full's LLaDA and Dream bodies) registers them
    under its checkpoints' names."""
    return (nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            nn.ModuleList(layer(i) for i in range(cfg.num_hidden_layers)),
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))


class SDARModel(nn.Module):
    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__()
        self.embed_tokens, self.layers, self.norm = trunk(cfg, lambda i: DecoderLayer(cfg, i))


class SDARForCausalLM(Placed, nn.Module):
    attention = "block_causal"  # dllm.full.FullAttentionLM's is "full" (LLaDA, Dream)
    family = "sdar"

    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = SDARModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self._layers_compiled = False
        self.init_weights()
        self._register_load_state_dict_pre_hook(self._fuse_hf_keys)

    def _fuse_hf_keys(self, state_dict: dict[str, torch.Tensor], prefix: str, *args: object) -> None:
        """load_state_dict accepts the HF layout (separate q/k/v, gate/up) too: fused here."""
        for name, m in self.named_modules():
            if isinstance(m, FusedLinear):
                m.fuse_hf_keys(state_dict, prefix + name.rpartition(".")[0] + ".")

    def init_weights(self, std: float = 0.02) -> None:
        """N(0, std) projection and embedding weights, zero biases, drawn tensor by tensor in
        the HF layout's order (a seed gives the same weights as separate q/k/v, gate/up)."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    rows = m.row_slices() if isinstance(m, FusedLinear) else [("", 0, m.weight.shape[0])]
                    for _, a, b in rows:
                        nn.init.normal_(m.weight[a:b], std=std)
                    if (bias := getattr(m, "bias", None)) is not None:
                        nn.init.zeros_(bias)

    def compile_layers(self, **options: Any) -> None:
        """torch.compile every decoder layer in place (forward and backward: the training step),
        with dynamic shapes (rows and lengths vary per step); the layers share one compiled
        graph. `gradient_checkpointing` still applies around each compiled layer."""
        for layer in self.model.layers:
            layer.compile(**{"dynamic": True, **options})
        self._layers_compiled = True

    def norms_on(self, device: torch.device) -> None:
        """Make every RMSNorm's lazy eps tensor on `device` now (a compiled graph guards on that state)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.eps_on(device)

    def hf_layout(self, remove_duplicate: bool = True) -> list[tuple[str, nn.Parameter, list[tuple[str, int, int]] | None]]:
        """[(parameter name, parameter, parts)]: parts is None where the parameter is one HF tensor
        under its own name, else [(HF name, first row, end row)] of a fused parameter."""
        fused = {name: m for name, m in self.named_modules() if isinstance(m, FusedLinear)}
        out: list[tuple[str, nn.Parameter, list[tuple[str, int, int]] | None]] = []
        for name, p in self.named_parameters(remove_duplicate=remove_duplicate):
            owner, _, attr = name.rpartition(".")
            m = fused.get(owner)
            if m is None:
                out.append((name, p, None))
                continue
            base = owner.rpartition(".")[0]
            out.append((name, p, [(f"{base}.{part}.{attr}", a, b) for part, a, b in m.row_slices()]))
        return out

    def hf_named_tensors(self, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight, as the checkpoint names them: a parameter itself, or
        a row slice of a fused one (a view: copying into it writes the fused parameter in place).
        What checkpoint loading, export, weight sync, digests and kept versions use."""
        for name, p, parts in self.hf_layout(remove_duplicate):
            if parts is None:
                yield name, p
                continue
            t = p.detach()
            for hf_name, a, b in parts:
                yield hf_name, t[a:b]

    def placed_weight(self) -> torch.Tensor:  # device / dtype (Placed)
        return self.lm_head.weight

    def hidden_states(self, ids: torch.Tensor, spec: MaskSpec, cache: CacheView | None = None) -> torch.Tensor:
        """ids: [B, L] -> final normed hidden states [B, L, hidden] (spec's mask built once, used by all layers)."""
        B, L = ids.shape
        # the layers work on [B * L, hidden] (2-D matmuls, no per-layer reshapes); not a view, so that the
        # first layer's input is like the others' (compiled layers: one graph)
        x = self.model.embed_tokens(ids.reshape(B * L))
        cos, sin = rope_cos_sin(spec.q_pos, self.config.head_dim, self.config.rope_theta, x.dtype)
        if cache is None:  # the mask built before the layers: compiled layers then share one graph
            cfg = self.config
            prepare(spec, B, L, spec.k_pos.shape[1], x.dtype, x.device, cfg.head_dim,
                    cfg.num_key_value_heads != cfg.num_attention_heads)
            if self._layers_compiled and not torch.compiler.is_compiling():
                mark_dynamic_lengths(x, cos, sin, spec)
                self.norms_on(x.device)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, spec, cache, use_reentrant=False)
            else:
                x = layer(x, cos, sin, spec, cache)
        return self.model.norm(x).view(B, L, -1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, page_table: torch.Tensor | None = None,
                k_valid: torch.Tensor | None = None, kv_len: int | None = None, write_mask: torch.Tensor | None = None,
                num_logits: int | None = None, num_logit_rows: int | None = None, clean_ids: torch.Tensor | None = None,
                valid: torch.Tensor | None = None,
                output: str = "logits") -> torch.Tensor:
        """Block-causal forward. input_ids/position_ids: [B, L] -> logits [B, L, V].

        With `cache` and `page_table` ([B, P] each row's KV pages), the tokens' K/V are written into
        the cache at their positions (tokens where write_mask [B, L] is False write nowhere
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
            if valid is None:
                raise ValueError("valid: the training layout (clean_ids) needs the valid mask")
            if output == "hidden":
                return self.hidden_train(input_ids, clean_ids, position_ids, valid)
            return self.forward_train(input_ids, clean_ids, position_ids, valid)
        bs = self.config.block_size
        if cache is None:
            spec = MaskSpec(position_ids, position_ids, bs, k_valid=k_valid)
            return self.lm_head(self.hidden_states(input_ids, spec))
        if kv_len is None:
            kv_len = int(position_ids.max()) + 1
        if page_table is None:
            raise ValueError("page_table: a forward on the KV cache needs each row's KV pages")
        k_pos = torch.arange(kv_len, device=input_ids.device).expand(B, kv_len)
        # keys beyond each row's own last position are stale cache entries
        k_valid = k_pos <= position_ids.max(dim=1, keepdim=True).values
        spec = MaskSpec(position_ids, k_pos, bs, k_valid=k_valid, backend="sdpa")  # decode: SDPA (dllm.attention)
        hidden = self.hidden_states(input_ids, spec, cache.view(page_table, position_ids, kv_len, write_mask))
        return self.lm_head(hidden[B - (num_logit_rows if num_logit_rows is not None else B):,
                                   L - (num_logits if num_logits is not None else L):])

    def train_spec(self, position_ids: torch.Tensor, valid: torch.Tensor) -> MaskSpec:
        B, L = position_ids.shape
        pos2 = torch.cat([position_ids, position_ids], dim=1)  # [B, 2L]
        noisy = torch.zeros(B, 2 * L, dtype=torch.bool, device=position_ids.device)
        noisy[:, :L] = True
        valid2 = torch.cat([valid, valid], dim=1)
        return MaskSpec(pos2, pos2, self.config.block_size, q_noisy=noisy, k_noisy=noisy, k_valid=valid2)

    def hidden_train(self, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, position_ids: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
        """Noisy copy + clean copy layout -> hidden states of the noisy copy [B, L, hidden]."""
        L = noisy_ids.shape[1]
        spec = self.train_spec(position_ids, valid)
        return self.hidden_states(torch.cat([noisy_ids, clean_ids], dim=1), spec)[:, :L]

    @overload
    def forward_train(self, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, position_ids: torch.Tensor,
                      valid: torch.Tensor, return_hidden: Literal[False] = False) -> torch.Tensor: ...
    @overload
    def forward_train(self, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, position_ids: torch.Tensor,
                      valid: torch.Tensor, return_hidden: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...
    def forward_train(self, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, position_ids: torch.Tensor,
                      valid: torch.Tensor, return_hidden: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Noisy copy + clean copy layout. All inputs [B, L]; returns logits of the noisy copy
        [B, L, V] (and its hidden states [B, L, hidden] with return_hidden)."""
        hidden = self.hidden_train(noisy_ids, clean_ids, position_ids, valid)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits
