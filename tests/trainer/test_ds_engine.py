"""DeepSpeed engine on CPU (gloo, one process): ZeRO 0/2/3, fp32/bf16, accumulation + clipping
against a plain torch AdamW step, full-parameter gathering, checkpoint resume, HF export.

All engines share the process's one default process group (initialised by the first
`build_engine`); the first run compiles DeepSpeed's shm op into .torch_extensions.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dllm.config import SDARConfig
from dllm.model import SDARForCausalLM

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".torch_extensions"))
pytest.importorskip("deepspeed")

from trainer.infra.ds_engine import (  # noqa: E402
    DSConfig,
    build_engine,
    export_hf,
    load_checkpoint,
    named_full_params,
    optimizer_step_count,
    param_groups,
    save_checkpoint,
)

B, L, MASK = 4, 8, 31
LR, CLIP, WD = 1e-2, 0.05, 0.01


def _config() -> SDARConfig:
    return SDARConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4,
                      mask_token_id=MASK, eos_token_id=0, torch_dtype="float32")


def _model(seed: int = 0) -> SDARForCausalLM:
    torch.manual_seed(seed)
    return SDARForCausalLM(_config())


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, MASK, (B, L), generator=g)
    is_masked = torch.rand(B, L, generator=g) < 0.5
    is_masked[:, 0] = True
    noisy = torch.where(is_masked, torch.full_like(clean, MASK), clean)
    pos = torch.arange(L).expand(B, L)
    return noisy, clean, pos, torch.ones(B, L, dtype=torch.bool), is_masked


def _loss(model, seed: int) -> torch.Tensor:
    noisy, clean, pos, valid, is_masked = _batch(seed)
    logits = model.forward_train(noisy, clean, pos, valid)  # [B, L, V]
    return F.cross_entropy(logits[is_masked].float(), clean[is_masked])


def _ds_step(engine, seeds) -> float:
    """One optimizer step = len(seeds) micro-batches; returns the mean micro loss."""
    losses = []
    for s in seeds:
        loss = _loss(engine.module, s)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.hf_named_tensors()}


@pytest.fixture(scope="module", params=[0, 2], ids=["zero0", "zero2"])
def run(request):
    """An fp32 engine at the given ZeRO stage: one accumulated step (2 micro-batches), compared
    with a plain torch AdamW step, then 6 more steps on a fixed batch."""
    cfg = DSConfig(zero_stage=request.param, grad_accum=2, grad_clip=CLIP, lr=LR, weight_decay=WD)
    ref = _model()
    engine = build_engine(_model(), cfg)
    initial = _snapshot(engine.module)
    opt = torch.optim.AdamW(param_groups(ref, WD), lr=LR)
    for s in (1, 2):
        (_loss(ref, s) / 2).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    opt.step()
    _ds_step(engine, (1, 2))
    after_one = _snapshot(engine.module)
    losses = [_ds_step(engine, (7, 7)) for _ in range(6)]
    return {"engine": engine, "initial": initial, "after_one": after_one, "ref": _snapshot(ref),
            "losses": losses}


def test_one_step_matches_torch_adamw_with_clipping(run):
    assert run["engine"].global_steps >= 1
    for name, p in run["ref"].items():
        torch.testing.assert_close(run["after_one"][name], p, atol=1e-6, rtol=1e-5, msg=name)


def test_steps_reduce_loss_and_change_every_param(run):
    losses = run["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    final = _snapshot(run["engine"].module)
    unchanged = [n for n, p in final.items() if torch.equal(p, run["initial"][n])]
    assert not unchanged
    assert optimizer_step_count(run["engine"]) == 7


def test_named_full_params_match_module(run):
    engine = run["engine"]
    state = dict(engine.module.hf_named_tensors())
    got = dict(named_full_params(engine))
    assert got.keys() == state.keys()
    for name, t in got.items():
        assert t.device.type == "cpu" and torch.equal(t, state[name].detach())
        assert t.data_ptr() != state[name].data_ptr()  # a copy: safe to push while training
    assert all(t.dtype == torch.bfloat16 for _, t in named_full_params(engine, dtype=torch.bfloat16))


def test_bf16_step():
    engine = build_engine(_model(), DSConfig(zero_stage=0, dtype="bf16", lr=LR))
    assert engine.module.lm_head.weight.dtype == torch.bfloat16
    before = _snapshot(engine.module)
    loss = _ds_step(engine, (3,))
    assert torch.isfinite(torch.tensor(loss)) and engine.global_steps == 1
    after = _snapshot(engine.module)
    assert all(not torch.equal(after[n], before[n]) for n in ("lm_head.weight", "model.norm.weight"))


def test_checkpoint_resume_restores_params_optimizer_scheduler_rng(tmp_path):
    cfg = DSConfig(zero_stage=2, grad_accum=1, lr=LR, warmup_steps=4)
    a = build_engine(_model(0), cfg)
    _ds_step(a, (1,))
    save_checkpoint(a, tmp_path / "ckpt", {"step": 1})
    _ds_step(a, (2,))
    client = {"step": 2, "version": 2, "sampler": {"epoch": 0, "index": 5}}
    assert save_checkpoint(a, tmp_path / "ckpt", client, keep_last=1) == "step2"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step*")) == ["step2"]
    saved = _snapshot(a.module)
    draw = torch.rand(3)  # RNG after the save
    _ds_step(a, (3,))
    continued = _snapshot(a.module)

    b = build_engine(_model(1), cfg)  # different init: everything must come from the checkpoint
    assert load_checkpoint(b, tmp_path / "ckpt") == client
    torch.testing.assert_close(torch.rand(3), draw)
    assert b.global_steps == 2 and optimizer_step_count(b) == 2
    for name, p in _snapshot(b.module).items():
        assert torch.equal(p, saved[name]), name
    _ds_step(b, (3,))  # same Adam moments and LR schedule -> same next step
    for name, p in _snapshot(b.module).items():
        torch.testing.assert_close(p, continued[name], atol=1e-6, rtol=1e-5, msg=name)


def test_value_model_gets_its_own_engine():
    from trainer.rl.objectives import value_loss
    from trainer.rl.value_model import ValueModel

    policy = build_engine(_model(), DSConfig(zero_stage=0, lr=LR))
    value = build_engine(ValueModel(policy.module), DSConfig(zero_stage=2, lr=LR))
    noisy, clean, pos, valid, _ = _batch(4)
    old = value(noisy, clean, pos, valid).detach()
    loss, _ = value_loss(value(noisy, clean, pos, valid), old, torch.ones(B, L), valid)
    value.backward(loss)
    value.step()
    assert not torch.allclose(value(noisy, clean, pos, valid), old)
    assert policy.global_steps == 0 and value.global_steps == 1


def test_zero3_gather_and_export(tmp_path):
    from dllm.weights import load_pretrained

    model = _model(5)
    expected = _snapshot(model)
    engine = build_engine(model, DSConfig(zero_stage=3, lr=LR))
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned
    got = dict(named_full_params(engine, bucket_numel=5000))
    assert got.keys() == expected.keys()
    for name, t in got.items():
        assert torch.equal(t, expected[name]), name
    from trainer.rl.value_model import ValueModel

    value = ValueModel(engine.module)  # copies from the partitioned policy (gathered)
    for name, p in value.backbone.hf_named_tensors():
        assert torch.equal(p, expected[name]), name
    export_hf(engine, _config(), tmp_path / "hf")
    loaded = load_pretrained(tmp_path / "hf")
    for name, p in loaded.hf_named_tensors():
        assert torch.equal(p, expected[name]), name
    losses = [_ds_step(engine, (7,)) for _ in range(3)]  # trains through engine.module.forward_train
    assert losses[-1] < losses[0]
    trained = dict(named_full_params(engine))
    assert all(not torch.equal(trained[n], expected[n]) for n in expected)


def test_export_bf16_records_dtype(tmp_path):
    import json

    engine = build_engine(_model(), DSConfig(zero_stage=0, dtype="bf16"))
    export_hf(engine, None, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert engine.module.config.torch_dtype == "float32"  # the live config is left alone


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="zero_stage"):
        DSConfig(zero_stage=4).validate()
    with pytest.raises(ValueError, match="dtype"):
        DSConfig(dtype="fp16").validate()
    conf = DSConfig(grad_accum=4, ds_overrides={"zero_optimization": {"overlap_comm": True}}).to_ds_config(2)
    assert conf["train_batch_size"] == 8 and conf["zero_optimization"] == {"stage": 0, "overlap_comm": True}
