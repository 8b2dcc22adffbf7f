"""TraceRL's diffusion value model: a copy of the policy backbone with a scalar value head.

    value = ValueModel(policy)                             # copies the policy's weights
    values = value(noisy, clean, pos, valid)               # [B, L] fp32, one value per noisy token
    loss, metrics = value_loss(values, old_values, returns, mask)

The backbone is an `SDARForCausalLM` built from the policy's config (its `lm_head` dropped:
values come from the last hidden states of the noisy copy, `hidden_train`), followed by
`v_head = nn.Linear(hidden, 1)`, zero-initialised by default so the first values are 0 and
the first update only moves the head. It shares no tensor with the policy, so value-loss
gradients never reach the policy.

Optimizer: the value model has its own. The trainer wraps it in a second DeepSpeed engine,
`trainer.ds_engine.build_engine(value, DSConfig(...))` (same process group, its own AdamW
and ZeRO sharding, checkpointed with `save_checkpoint` into its own folder); a plain
`torch.optim.AdamW(value.parameters())` works as well (the tests use one). Under ZeRO-3
the policy's parameters are partitioned: build from the config and copy gathered weights,
`ValueModel(policy.config)` then `value.load_backbone(named_full_params(policy_engine))`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from dllm.config import SDARConfig
from dllm.model import RMSNorm, SDARForCausalLM
from dllm.weights import copy_into_model


class ValueModel(nn.Module):
    def __init__(self, policy: SDARForCausalLM | SDARConfig, head_init_std: float = 0.0,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        """policy: a policy model (its weights are copied) or a config (random backbone).
        head_init_std: 0 zero-initialises `v_head`; > 0 draws its weight from N(0, std)."""
        super().__init__()
        is_model = isinstance(policy, nn.Module)
        cfg = policy.config if is_model else policy
        ref = next(policy.parameters()) if is_model else None
        device = device or (ref.device if ref is not None else "cpu")
        dtype = dtype or (ref.dtype if ref is not None else torch.float32)
        with torch.device("meta"):
            backbone = SDARForCausalLM(cfg)
        backbone.lm_head = None  # values are read from hidden states: no vocab projection
        self.backbone = backbone.to_empty(device=device).to(dtype)
        self.v_head = nn.Linear(cfg.hidden_size, 1, device=device, dtype=dtype)
        self.reset_head(head_init_std)
        if is_model:
            self.load_backbone(policy.named_parameters())
        else:
            self.backbone.init_weights()
            for m in self.backbone.modules():  # to_empty leaves norm weights uninitialised
                if isinstance(m, RMSNorm):
                    nn.init.ones_(m.weight)

    @property
    def config(self) -> SDARConfig:
        return self.backbone.config

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
        """Copy policy weights (SDAR names; `lm_head.*` ignored) into the backbone. Every
        backbone parameter must be given; shapes are checked before anything is copied."""
        items = [(n, t) for n, t in named_tensors if not n.startswith("lm_head.")]
        copy_into_model(self.backbone, items, strict=True)

    def forward(self, noisy_ids: torch.Tensor, clean_ids: torch.Tensor, position_ids: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        """All inputs [B, L] (training layout of `SDARForCausalLM.forward_train`) -> values [B, L]
        fp32 at the noisy-copy positions."""
        hidden = self.backbone.hidden_train(noisy_ids, clean_ids, position_ids, valid)  # [B, L, D]
        values = self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1)  # [B, L]
        return values.float()
