"""Tests for trainer.rl.advantages: GRPO group z-scores, DAPO filtering, TraceRL step-wise GAE."""

import pytest
import torch

from trainer.rl.advantages import (
    filter_zero_variance_groups,
    group_advantages,
    sequence_to_token_rewards,
    stepwise_gae,
    stepwise_gae_batch,
    zero_variance_groups,
)


def test_group_advantages_zscore():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, group_size=4, eps=0.0)
    # group 1: mean 0.5, unbiased std sqrt(1/3)
    s = (1 / 3) ** 0.5
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s)
    assert torch.equal(adv[4:], torch.zeros(4))  # zero-variance group -> 0 (eps avoids 0/0)
    assert torch.equal(group_advantages(r, 4, eps=1e-6)[4:], torch.zeros(4))
    assert torch.allclose(group_advantages(r, 4, scale="none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert torch.equal(group_advantages(r, 1), torch.zeros(8))


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), group_size=2, scale="mad")


def test_zero_variance_filter():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert zero_variance_groups(r, 2).tolist() == [True, False, True, True]
    keep, frac = filter_zero_variance_groups(r, 2)
    assert keep.tolist() == [False, False, True, True, False, False, False, False]
    assert frac == pytest.approx(0.75)
    keep, frac = filter_zero_variance_groups(torch.tensor([0.0, 1e-9]), 2, atol=1e-6)
    assert keep.tolist() == [False, False] and frac == 1.0


def test_stepwise_gae_hand_computed():
    # Tokens in arbitrary order. gamma = 0.9, lam = 0.5 (gamma * lam = 0.45).
    steps = torch.tensor([2, 0, 1, 0, 2])
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5])
    v = torch.tensor([0.6, 0.2, 0.4, 0.3, 0.8])
    # step aggregates: r* = [0, 0, 0.75], V* = [0.25, 0.4, 0.7]
    # R*_2 = 0.75, R*_1 = 0.675, R*_0 = 0.6075
    # d*_2 = 0.05, d*_1 = -0.4 + 0.63 = 0.23, d*_0 = -0.25 + 0.36 = 0.11
    # A*_2 = 0.05, A*_1 = 0.23 + 0.45 * 0.05 = 0.2525, A*_0 = 0.11 + 0.45 * 0.2525 = 0.223625
    # token j: R_j = r_j + 0.9 R*_{t+1};  A_j = r_j - V_j + 0.9 V*_{t+1} + 0.45 A*_{t+1}
    returns, adv = stepwise_gae(r, v, steps, gamma=0.9, lam=0.5)
    assert torch.allclose(returns, torch.tensor([1.0, 0.6075, 0.675, 0.6075, 0.5]), atol=1e-6)
    assert torch.allclose(adv, torch.tensor([0.4, 0.273625, 0.2525, 0.173625, -0.3]), atol=1e-6)


def _reference(r, v, steps, gamma, lam):
    """Direct loop implementation of the definitions (python floats)."""
    order = sorted(set(steps))
    rs = [sum(r[j] for j in range(len(r)) if steps[j] == t) / steps.count(t) for t in order]
    vs = [sum(v[j] for j in range(len(r)) if steps[j] == t) / steps.count(t) for t in order]
    T = len(order)
    R, A, V = [0.0] * (T + 1), [0.0] * (T + 1), vs + [0.0]
    for t in reversed(range(T)):
        R[t] = rs[t] + gamma * R[t + 1]
        A[t] = rs[t] - V[t] + gamma * V[t + 1] + gamma * lam * A[t + 1]
    rank = {s: i for i, s in enumerate(order)}
    ret = [r[j] + gamma * R[rank[steps[j]] + 1] for j in range(len(r))]
    adv = [r[j] - v[j] + gamma * V[rank[steps[j]] + 1] + gamma * lam * A[rank[steps[j]] + 1] for j in range(len(r))]
    return torch.tensor(ret), torch.tensor(adv)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.0), (0.95, 0.9), (0.5, 0.0)])
def test_stepwise_gae_matches_reference(gamma, lam):
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        L = 12
        steps = torch.randint(0, 6, (L,), generator=g)
        r, v = torch.randn(L, generator=g), torch.randn(L, generator=g)
        ret, adv = stepwise_gae(r, v, steps, gamma, lam)
        ref_ret, ref_adv = _reference(r.tolist(), v.tolist(), steps.tolist(), gamma, lam)
        assert torch.allclose(ret, ref_ret, atol=1e-5) and torch.allclose(adv, ref_adv, atol=1e-5)


def test_stepwise_gae_special_cases():
    g = torch.Generator().manual_seed(1)
    steps = torch.tensor([3, 0, 1, 1, 2, 0, 3, 2])
    r, v = torch.randn(8, generator=g), torch.randn(8, generator=g)
    r_step = torch.stack([r[steps == t].mean() for t in range(4)])
    v_step = torch.cat([torch.stack([v[steps == t].mean() for t in range(4)]), torch.zeros(1)])
    # gamma = 1: R_j = r_j + sum_{s > t(j)} r*_s; with lam = 1 as well, A_j = R_j - V_j (telescoping).
    later = torch.stack([r_step[t + 1:].sum() for t in steps.tolist()])
    ret, adv = stepwise_gae(r, v, steps, gamma=1.0, lam=1.0)
    assert torch.allclose(ret, r + later, atol=1e-6)
    assert torch.allclose(adv, ret - v, atol=1e-6)
    # gamma = 1, lam = 0: A_j = r_j - V_j + V*_{t(j)+1} (one-step TD error).
    _, adv0 = stepwise_gae(r, v, steps, gamma=1.0, lam=0.0)
    assert torch.allclose(adv0, r - v + v_step[steps + 1], atol=1e-6)


def test_stepwise_gae_skips_empty_steps():
    r, v = torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.tensor([0.1, 0.2, 0.3, 0.4])
    a = stepwise_gae(r, v, torch.tensor([0, 5, 5, 9]), 0.9, 0.7)
    b = stepwise_gae(r, v, torch.tensor([0, 1, 1, 2]), 0.9, 0.7)
    assert torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_stepwise_gae_batch_matches_rows_and_zeroes_padding():
    g = torch.Generator().manual_seed(2)
    B, L = 3, 7
    steps = torch.randint(0, 5, (B, L), generator=g)
    r, v = torch.randn(B, L, generator=g), torch.randn(B, L, generator=g)
    valid = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [0] * 7]).bool()
    r_pad = torch.where(valid, r, torch.full_like(r, 1e9))  # padding values must not leak
    ret, adv = stepwise_gae_batch(r_pad, v, steps, valid, gamma=0.9, lam=0.8)
    for b in range(2):
        n = int(valid[b].sum())
        ret_b, adv_b = stepwise_gae(r[b, :n], v[b, :n], steps[b, :n], 0.9, 0.8)
        assert torch.allclose(ret[b, :n], ret_b, atol=1e-6) and torch.allclose(adv[b, :n], adv_b, atol=1e-6)
    assert torch.equal(ret[~valid], torch.zeros(int((~valid).sum())))
    assert torch.equal(adv[~valid], torch.zeros(int((~valid).sum())))
    with pytest.raises(ValueError, match="shapes"):
        stepwise_gae_batch(r, v, steps[:, :3], valid)


def test_sequence_reward_on_last_step():
    steps = torch.tensor([[0, 1, 2, 2, 0], [1, 0, 1, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool()
    tok_r = sequence_to_token_rewards(torch.tensor([2.0, -1.0]), steps, valid)
    assert tok_r.tolist() == [[0, 0, 2, 2, 0], [-1, 0, -1, 0, 0]]
    # gamma = 1: every valid token's return is the sequence reward
    ret, _ = stepwise_gae_batch(tok_r, torch.zeros(2, 5), steps, valid, gamma=1.0, lam=1.0)
    assert ret.tolist() == [[2, 2, 2, 2, 0], [-1, -1, -1, -1, -1]]


# ------------------------------------------------------------- step-wise GAE on shrunk traces (issue 18)
def _paper_gae(prompt_len, block_size, steps, values, reward, shrink, gamma, lam, origin=0):
    """TraceRL's step-wise GAE written out directly: tokens -> (block, ceil(step / shrink)) steps in
    decoding order (blocks from absolute position `origin`); one value per step (the mean over its tokens);
    the reward on the last step; backward recursions for the step returns and GAE; each token: its own
    value and the next step's."""
    key = [((prompt_len + j - origin) // block_size, -(-st // shrink)) for j, st in enumerate(steps)]
    order = sorted(set(key))
    T = len(order)
    v_step = [sum(v for k, v in zip(key, values) if k == o) / sum(k == o for k in key) for o in order]
    r_step = [0.0] * T
    r_step[-1] = reward
    ret, adv = [0.0] * (T + 1), [0.0] * (T + 1)
    v_next = v_step + [0.0]
    for t in range(T - 1, -1, -1):
        ret[t] = r_step[t] + gamma * ret[t + 1]
        adv[t] = r_step[t] - v_step[t] + gamma * v_next[t + 1] + gamma * lam * adv[t + 1]
    out_ret, out_adv = [], []
    for k, v in zip(key, values):
        t = order.index(k)
        r = reward if t == T - 1 else 0.0
        out_ret.append(r + gamma * ret[t + 1])
        out_adv.append(r - v + gamma * v_next[t + 1] + gamma * lam * adv[t + 1])
    return out_ret, out_adv


def _trace(prompt_len, block_size, steps, origin=0):
    from dllm.trace import Trace

    return Trace(prompt_len=prompt_len, block_size=block_size, steps=steps, logprobs=[0.0] * len(steps),
                 block_origin=origin)


def test_shrink_smallest_case_from_the_issue():
    from trainer.rl.advantages import trace_gae

    tr = _trace(0, 4, [1, 2, 3, 4])
    _, adv = trace_gae([tr], torch.tensor([[0.1, 0.2, 0.3, 0.4]]), torch.tensor([1.0]), shrink=2, gamma=1.0, lam=0.0)
    assert adv[0].tolist() == pytest.approx([0.25, 0.15, 0.70, 0.60])


@pytest.mark.parametrize("shrink", [1, 2, 3])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.0), (0.9, 0.95), (0.5, 0.3)])
def test_trace_gae_matches_the_paper_formula(shrink, gamma, lam):
    """Random traces: any commit order inside blocks, a prompt ending mid-block, a truncated last block."""
    from trainer.rl.advantages import trace_gae

    g = torch.Generator().manual_seed(shrink * 100 + int(gamma * 10) + int(lam * 10))
    traces, values, rewards, B = [], [], [], 4
    for _ in range(6):
        P = int(torch.randint(1, 9, (1,), generator=g))
        n = int(torch.randint(1, 15, (1,), generator=g))  # completion length: last block often truncated
        steps, j = [], 0
        while j < n:
            start = (P + j) // B * B
            width = min(start + B - (P + j), n - j)  # this block's completion tokens
            full = start + B - (P + j)  # ... of which the first `width` were kept
            perm = torch.randperm(full, generator=g)[:width] + 1  # commit steps, any order
            steps += perm.tolist()
            j += width
        traces.append(_trace(P, B, steps))
        values.append(torch.rand(n, generator=g).tolist())
        rewards.append(float(torch.rand((), generator=g)))
    L = max(len(v) for v in values)
    tok_v = torch.zeros(len(values), L)
    for i, v in enumerate(values):
        tok_v[i, :len(v)] = torch.tensor(v)
    ret, adv = trace_gae(traces, tok_v, torch.tensor(rewards), shrink, gamma, lam)
    for i, tr in enumerate(traces):
        exp_ret, exp_adv = _paper_gae(tr.prompt_len, B, tr.steps, values[i], rewards[i], shrink, gamma, lam)
        n = len(tr.steps)
        assert ret[i, :n].tolist() == pytest.approx(exp_ret, abs=1e-5)
        assert adv[i, :n].tolist() == pytest.approx(exp_adv, abs=1e-5)
        assert torch.count_nonzero(adv[i, n:]) == 0


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (1.0, 0.0)])
def test_trace_gae_full_attention_traces(gamma, lam):
    """Hand-made LLaDA / Dream traces (blocks from the prompt's end, `block_origin` = prompt length): Dream's
    schedule [1, 0, 1, 2] leaves step 2 empty, a stop cuts the last block, prompts of unaligned lengths. The
    returns and advantages of the value model's step-wise GAE equal the direct computation."""
    from trainer.rl.advantages import trace_gae

    B = 4
    cases = [  # (prompt length, steps of the completion tokens)
        (6, [1, 3, 4, 4, 2, 1, 4, 3, 1]),  # LLaDA-like, 1 token per step; last block cut after 1 token
        (5, [1, 4, 3, 4, 1, 4, 4, 3]),  # Dream-like: step 2 of every block commits nothing
        (9, [1, 1, 2, 2, 2, 1, 2]),  # 2 tokens per step
    ]
    traces = [_trace(P, B, st, origin=P) for P, st in cases]
    values = [[0.1 * (j % 5) - 0.2 for j in range(len(st))] for _, st in cases]
    rewards = [1.0, 0.0, 0.5]
    tok_v = torch.zeros(3, 9)
    for i, v in enumerate(values):
        tok_v[i, :len(v)] = torch.tensor(v)
    ret, adv = trace_gae(traces, tok_v, torch.tensor(rewards), 1, gamma, lam)
    for i, (P, st) in enumerate(cases):
        exp_ret, exp_adv = _paper_gae(P, B, st, values[i], rewards[i], 1, gamma, lam, origin=P)
        assert ret[i, :len(st)].tolist() == pytest.approx(exp_ret, abs=1e-6)
        assert adv[i, :len(st)].tolist() == pytest.approx(exp_adv, abs=1e-6)
        wrong = _paper_gae(P, B, st, values[i], rewards[i], 1, gamma, lam, origin=0)[1]
        if (gamma, lam) != (1.0, 1.0):  # (with both 1 the advantage telescopes to R - V_j whatever the steps)
            assert adv[i, :len(st)].tolist() != pytest.approx(wrong, abs=1e-6)  # the alignment matters
    # Dream's empty step 2: tokens of step 1 take the value of step 3 as their next step's
    assert traces[1].global_steps()[:4] == [1, 4, 3, 4]
