"""Commit rules of block decoding: which masked positions a denoising forward fills in.

    ks = transfer_schedule(num_masked=4, steps=2)          # [2, 2]: tokens per forward
    commit = commit_mask(conf, masked, k, threshold, strategy_codes)   # [N, B] bool, all rows at once

Strategies (per sequence, mixed freely within one batch):
- `static`: the k most confident masked positions, k from the `steps` schedule;
- `dynamic` (as SDAR / TraDo): every masked position whose confidence is strictly above
  the threshold, and at least the k the schedule asks for (the k most confident);
- `sequential`: the k leftmost masked positions.
Confidence is the probability of the token sampled at the position. Ties rank the lower
position first. `commit_positions` is the same rule for one sequence in plain Python (the
definition the batched rule is tested against).
"""

from __future__ import annotations

import torch

from dllm.strategy import Strategy


def commit_mask(conf: torch.Tensor, masked: torch.Tensor, k: torch.Tensor, threshold: torch.Tensor,
                strategy: torch.Tensor, used: set[str] | None = None) -> torch.Tensor:
    """conf: [N, B] probability of each sampled token, masked: [N, B] bool, k / threshold /
    strategy (`Strategy.code`): [N] -> positions to commit [N, B] bool (always masked ones).
    `used`: the strategies present, when the caller knows (the others are not computed)."""
    N, B = conf.shape
    used = set(Strategy) if used is None else used
    k = torch.minimum(k, masked.sum(-1))[:, None]  # [N, 1]
    rules = {}
    if "sequential" in used:
        rules["sequential"] = masked & (masked.cumsum(-1) <= k)  # the k leftmost
    if used & {"static", "dynamic"}:
        conf = conf.masked_fill(~masked, -1.0)  # unmasked positions rank last
        order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(B, device=conf.device).expand(N, B))
        rules["static"] = top = masked & (rank < k)  # the k most confident
        if "dynamic" in used:
            above = masked & (conf > threshold[:, None])
            rules["dynamic"] = torch.where(above.sum(-1, keepdim=True) >= k, above, top)
    names = [name for name in Strategy if name in used]
    out = rules[names[0]]
    for name in names[1:]:
        out = torch.where(strategy[:, None] == name.code, rules[name], out)
    return out


def commit_positions(conf: list[float], masked: list[int], k: int, threshold: float, strategy: str) -> list[int]:
    """The rule for one sequence: masked positions (ascending) and their confidences -> positions to commit."""
    k = min(k, len(masked))
    if strategy == "sequential":
        return masked[:k]
    ranked = sorted(masked, key=lambda i: -conf[i])
    if strategy == "static":
        return ranked[:k]
    above = [i for i in ranked if conf[i] > threshold]
    return above if len(above) >= k else ranked[:k]
