"""TraceRL's diffusion value model: a copy of the policy backbone with a scalar value head.

    value = ValueModel(policy, lr=1e-5)                    # copies the policy's weights
    values = value(noisy, clean, pos, valid)               # [B, L] fp32, one value per noisy token
    loss, metrics = value_loss(values, old_values, returns, mask)
    value.optimizer.zero_grad(); loss.backward(); value.optimizer.step()

The backbone is the policy's family built from its config, its vocabulary projection dropped, followed by
`v_head = nn.Linear(hidden, 1)`, zero-initialised by default so the first values are 0 and the first update
only moves the head:
- block-causal SDAR (`SDARForCausalLM`): values from the last hidden states of the noisy copy of the
  block-causal training rows (`hidden_train`);
- full attention, LLaDA / Dream (`dllm.full.FullAttentionLM`): a bidirectional value head over the same rows
  the policy replays (dllm.full.replay: one canvas per trace step, `clean` unused), read where the policy
  scores each token (Dream's shift applied), so V_j is the value of the state that committed token j.
It shares no tensor with the policy, so value-loss gradients never reach the policy. Parameters are fp32
unless `dtype` says otherwise. The step-wise GAE over its values is trainer.rl.advantages' (the same
recursions for every family: the trace's global steps, blocks from its `block_origin`).

Optimizer: the value model has its own. With `lr` it owns a plain `torch.optim.AdamW`
(`value.optimizer`; `value.save(path)` / `value.load(path)` checkpoint both), which is what the
tiny default uses. For large models wrap it in a second DeepSpeed engine instead:
`trainer.infra.ds_engine.build_engine(ValueModel(policy), DSConfig(...))` (same process group, its
own AdamW and ZeRO sharding, checkpointed with `ds_engine.save_checkpoint`). The policy may be
a ZeRO-3 partitioned module: its parameters are gathered while they are copied.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from dllm.config import SDARConfig
from dllm.full.config import FullAttentionConfig
from dllm.full.model import FullAttentionLM, LLaDABody
from dllm.meta import materialize, on_meta
from dllm.model import RMSNorm, SDARForCausalLM
from dllm.weights import copy_into_model
from trainer.infra.ds_engine import named_full_params

Policy = SDARForCausalLM | FullAttentionLM
HEADS = {"llada": "model.transformer.ff_out.", "dream": "lm_head."}  # an untied vocabulary projection's names
PolicyConfig = SDARConfig | FullAttentionConfig


def _headless_backbone(cfg: PolicyConfig) -> Policy:
    """The family's model on the meta device without its untied vocabulary projection (a tied one is the
    embedding, which the backbone keeps)."""
    with on_meta():
        if isinstance(cfg, FullAttentionConfig):
            full = FullAttentionLM(cfg)
            if not cfg.tie_word_embeddings:
                if isinstance(full.model, LLaDABody):
                    full.model.transformer.register_module("ff_out", None)
                else:
                    full.register_module("lm_head", None)
            full.__dict__["_head"] = None  # values are read from hidden states: no vocab projection
            return full
        backbone = SDARForCausalLM(cfg)
    backbone.register_module("lm_head", None)
    return backbone


class ValueModel(nn.Module):
    def __init__(self, policy: Policy | PolicyConfig, lr: float | None = None,
                 weight_decay: float = 0.0, head_init_std: float = 0.0,
                 device: str | torch.device | None = None, dtype: torch.dtype = torch.float32):
        """policy: a policy model (its weights are copied) or a config (random backbone).
        lr: create `self.optimizer` (torch AdamW); None leaves it to the caller (DeepSpeed).
        head_init_std: 0 zero-initialises `v_head`; > 0 draws its weight from N(0, std)."""
        super().__init__()
        if isinstance(policy, nn.Module):
            cfg, device = policy.config, device or next(policy.parameters()).device
        else:
            cfg, device = policy, device or "cpu"
        self.backbone = materialize(_headless_backbone(cfg), device, dtype)
        self.v_head = nn.Linear(cfg.hidden_size, 1, device=device, dtype=dtype)
        self.reset_head(head_init_std)
        if isinstance(policy, nn.Module):
            self.load_backbone(named_full_params(policy))
        else:
            self.backbone.init_weights()
            for m in self.backbone.modules():  # to_empty leaves norm weights uninitialised
                if isinstance(m, RMSNorm):
                    nn.init.ones_(m.weight)
        self.optimizer = None
        if lr is not None:
            self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)

    @property
    def config(self) -> PolicyConfig:
        return self.backbone.config

    @property
    def device(self) -> torch.device:
        return self.v_head.weight.device

    @property
    def gradient_checkpointing(self) -> bool:
        return self.backbone.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        self.backbone.gradient_checkpointing = value

    def reset_head(self, std: float = 0.0) -> None:
        with torch.no_grad():
            if std > 0:
                nn.init.normal_(self.v_head.weight, std=std)
            else:
                nn.init.zeros_(self.v_head.weight)
            nn.init.zeros_(self.v_head.bias)

    def load_backbone(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy policy weights (the family's official names; the vocabulary projection ignored) into the
        backbone. Every backbone parameter must be given; shapes are checked before anything is copied."""
        head = HEADS.get(getattr(self.config, "family", "sdar"), "lm_head.")
        items = [(n, t) for n, t in named_tensors if not n.startswith(head)]
        copy_into_model(self.backbone, items, strict=True)

    def forward(self, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, position_ids: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        """All inputs [B, L] (SDAR: the training layout of `SDARForCausalLM.forward_train`; full attention: the
        replay rows, `clean_ids` unused) -> values [B, L] fp32 at the noisy positions."""
        if isinstance(self.backbone, FullAttentionLM):
            hidden = self.backbone(noisy_ids, position_ids=position_ids, valid=valid, output="hidden")  # [B, L, D]
        else:
            hidden = self.backbone.hidden_train(noisy_ids, clean_ids, position_ids, valid)  # [B, L, D]
        values = self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1)  # [B, L]
        return values.float()

    def save(self, path: str | Path) -> None:
        """Weights (+ optimizer state when it owns one) to one torch file, for resume."""
        state = {"model": self.state_dict(),
                 "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)

    def load(self, path: str | Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
