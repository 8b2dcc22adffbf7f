"""The official per-family decoding schedules of LLaDA and Dream (Gen-Verse/dLLM-RL's rollouts), and the window
of a prefix-cache forward.

    llada_schedule(num_masked=32, steps=32)        # [1, 1, ..., 1]: LLaDA's get_num_transfer_tokens
    dream_schedule(num_masked=8, steps=8)          # [1, 0, 1, 1, 1, 1, 1, 2]: Dream's first token, then its timesteps
    window_end(block_end=40, canvas_len=300, further_horizon=128)   # 168: what a block's later forwards see
    resolve_horizon("dream", AUTO_HORIZON)         # 32: the official RL config's further_horizon

Static decoding commits, at each forward of a block, the count the family's schedule gives (every block
starts fully masked: blocks start at the prompt's end):
- LLaDA (`sample/llada_rl_rollout.py: get_num_transfer_tokens`): the block's masks split evenly over the
  steps, the first `num_masked % steps` steps one more;
- Dream (`sample/dream_rl_rollout.py: _sample`): the block's first forward commits its first position alone,
  then forward i = 1 .. steps - 1 commits `int(n * (1 - s / t))` of the n masks left, with t, s =
  timesteps[i], timesteps[i + 1] of `linspace(1, eps, steps + 1)` (float32, as the official tensors), and
  the last forward all that are left. Some forwards commit nothing (steps 8 over a block of 8:
  [1, 0, 1, 1, 1, 1, 1, 2]); they still count as forwards (the trace's steps skip them). With one step
  (the official code fails there) the block takes two forwards: [1, n - 1].

`further_horizon` (prefix-cache mode): a block's later forwards run [block start, min(block end + horizon,
canvas end)) against the cached keys / values before the block; the official RL configs use 128 (LLaDA) and
32 (Dream) -- `AUTO_HORIZON` picks those; None: the rest of the canvas (Fast-dLLM's plain prefix cache).
"""

from __future__ import annotations

import torch

from dllm.strategy import transfer_schedule

DREAM_EPS = 1e-3  # DreamGenerationConfig's default eps (the RL configs keep it)
OFFICIAL_HORIZON = {"llada": 128, "dream": 32}  # configs/rl_llada.yaml, configs/rl_dream.yaml: further_horizon
AUTO_HORIZON = -1  # further_horizon: the family's official value


def llada_schedule(num_masked: int, steps: int) -> list[int]:
    """LLaDA's `get_num_transfer_tokens` for one block: tokens per forward (`steps` forwards at most)."""
    return transfer_schedule(num_masked, steps)


def dream_schedule(num_masked: int, steps: int, eps: float = DREAM_EPS) -> list[int]:
    """Dream's static schedule for a block of `num_masked` masks in `steps` forwards (see the module docstring)."""
    if num_masked <= 1:
        return [num_masked]
    if steps <= 1:
        return [1, num_masked - 1]
    times = torch.linspace(1, eps, steps + 1)  # float32, as the official `timesteps`
    out, left = [1], num_masked - 1
    for i in range(1, steps):
        if i == steps - 1:
            k = left
        else:
            frac = torch.tensor(left) / 1  # the official `mask_index.sum() / batch`: a float32 tensor
            k = int(frac * (1 - times[i + 1] / times[i]))
        out.append(k)
        left -= k
    return out


def schedule_name(family: str, eps: float = DREAM_EPS) -> str:
    """What a trace records as its `schedule`."""
    return "llada" if family == "llada" else f"dream eps={eps:g}"


def family_schedule(family: str, num_masked: int, steps: int, eps: float = DREAM_EPS) -> list[int]:
    return llada_schedule(num_masked, steps) if family == "llada" else dream_schedule(num_masked, steps, eps)


def resolve_horizon(family: str, further_horizon: int | None) -> int | None:
    """AUTO_HORIZON -> the family's official value; None stays None (the rest of the canvas)."""
    if further_horizon is None:
        return None
    if isinstance(further_horizon, bool) or not isinstance(further_horizon, int) or further_horizon < AUTO_HORIZON:
        raise ValueError(f"further_horizon: must be an integer >= 0 (or {AUTO_HORIZON}: the family's official "
                         f"value), got {further_horizon!r}")
    return OFFICIAL_HORIZON[family] if further_horizon == AUTO_HORIZON else further_horizon


def window_end(block_end: int, canvas_len: int, further_horizon: int | None) -> int:
    """The end of what a prefix-cache forward after a block's first sees: block end + horizon, within the canvas."""
    return canvas_len if further_horizon is None else min(block_end + further_horizon, canvas_len)
