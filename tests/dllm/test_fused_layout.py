"""The fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj) are a load-time layout only.

    .venv/bin/python -m pytest -q tests/dllm/test_fused_layout.py

Checks: the fused model computes what separate projections compute (a plain reference
written here with the HF tensors, fp32 and bf16, with and without biases); a Hugging Face
folder in the real SDAR layout (the SDAR-1.7B fixture config, shrunk; sharded) loads into
the fused rows; an export gives byte-identical HF tensors; HF-layout state dicts load; a
push over the real sender and receiver (http and shm) lands in the fused parameters in
place with the trainer's checksum, and a rollback restores it; ZeRO-3 gathers of a fused
parameter are sent under the HF names.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from dllm.attention import MaskSpec, attend
from dllm.config import SDARConfig
from dllm.export import export_pretrained
from dllm.model import SDARForCausalLM
from dllm.weights import load_pretrained, save_weights
from tests.helpers import fake_zero3_gather
from tests.weight_sync.test_weight_sync_transports import TOKEN, FakeEngine, ReceiverServer
from weight_sync import iter_deepspeed_params, push, weights_digest

FIXTURE = Path("/work/shared/fixtures/sdar-1.7b-chat.config.json")
SHRINK = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "mask_token_id": 127,
          "bos_token_id": 0, "eos_token_id": 1}


def small_cfg(**kw) -> SDARConfig:
    return SDARConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4,
                      mask_token_id=63, eos_token_id=62, **kw)


def reference_logits(w: dict[str, torch.Tensor], cfg: SDARConfig, ids, pos) -> torch.Tensor:
    """The unfused maths (HF Qwen3 with block-causal attention), from HF-named tensors."""
    def norm(x, weight):
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(x.dtype)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def lin(x, name):
        return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    B, L = ids.shape
    D, H, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    x = w["model.embed_tokens.weight"][ids]
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.cat([pos.float()[..., None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    spec = MaskSpec(pos, pos, cfg.block_size)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = norm(lin(h, p + "self_attn.q_proj").view(B, L, H, D), w[p + "self_attn.q_norm.weight"]).transpose(1, 2)
        k = norm(lin(h, p + "self_attn.k_proj").view(B, L, Hkv, D), w[p + "self_attn.k_norm.weight"]).transpose(1, 2)
        v = lin(h, p + "self_attn.v_proj").view(B, L, Hkv, D).transpose(1, 2)
        out = attend(rope(q, cos, sin), rope(k, cos, sin), v, spec).transpose(1, 2).reshape(B, L, -1)
        x = x + lin(out, p + "self_attn.o_proj")
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + lin(F.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    return lin(norm(x, w["model.norm.weight"]), "lm_head")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_model_equals_separate_projections(dtype, tol, bias):
    torch.manual_seed(0)
    model = SDARForCausalLM(small_cfg(attention_bias=bias)).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, t in model.hf_named_tensors():
            if "norm" in name or name.endswith(".bias"):
                t.copy_(torch.randn(t.shape) * 0.1 + (1.0 if "norm" in name else 0.0))
    names = [n for n, _ in model.hf_named_tensors()]
    assert "model.layers.1.self_attn.k_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == bias
    ids = torch.randint(0, 60, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        ours = model(ids, pos).float()
        ref = reference_logits(dict(model.hf_named_tensors()), model.config, ids, pos).float()
    assert (ours - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())


def test_inference_forward_follows_weight_updates_and_replacements():
    """Inference reuses each projection's transposed weight view (and rotates q/k in place): an
    in-place update, a replaced `.data` and a dtype change all show in the next forward, which
    stays equal to the autograd path's (fresh views, out of place) and to the reference."""
    torch.manual_seed(0)
    model = SDARForCausalLM(small_cfg(attention_bias=True)).eval()
    ids = torch.randint(0, 60, (2, 8))
    pos = torch.arange(8).expand(2, 8)

    def check(tol=0.0):
        with torch.no_grad():
            ours = model(ids, pos)
            ref = reference_logits(dict(model.hf_named_tensors()), model.config, ids, pos)
        grad_path = model(ids, pos).detach()
        assert torch.equal(ours, grad_path)
        assert (ours.float() - ref.float()).abs().max() <= max(tol, 2e-5) * max(1.0, ref.abs().max().item())

    check()
    qkv = model.model.layers[0].self_attn.qkv_proj
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # in place (what weight sync does)
    check()
    qkv.weight.data = torch.randn_like(qkv.weight)  # replaced storage
    model.model.layers[1].mlp.down_proj.weight.data = torch.randn(32, 48).t().contiguous().t()  # other layout
    check()
    model.to(torch.bfloat16)
    check(tol=0.05)


def real_layout_folder(tmp_path: Path, dtype: torch.dtype) -> tuple[Path, dict[str, torch.Tensor]]:
    """The SDAR-1.7B fixture config shrunk, with random weights in the HF layout, sharded."""
    data = json.loads(FIXTURE.read_text())
    data.update(SHRINK, torch_dtype=str(dtype).removeprefix("torch."))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    cfg = SDARConfig.from_dict(data)
    with torch.device("meta"):
        shapes = [(n, t.shape) for n, t in SDARForCausalLM(cfg).hf_named_tensors()]
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes}
    save_weights(tensors.items(), folder, max_shard_bytes=64 << 10)
    assert (folder / "model.safetensors.index.json").is_file()  # several shards
    return folder, tensors


@pytest.mark.skipif(not FIXTURE.is_file(), reason="needs the shared SDAR-1.7B config fixture")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_layout_folder_fuses_and_exports_byte_identical(tmp_path, dtype):
    folder, tensors = real_layout_folder(tmp_path, dtype)
    model = load_pretrained(folder, dtype=dtype)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    assert torch.equal(attn.qkv_proj.weight, torch.cat([tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight,
                       torch.cat([tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]))
    views = dict(model.hf_named_tensors())
    assert set(views) == set(tensors)
    assert views[p + "self_attn.k_proj.weight"].data_ptr() != attn.qkv_proj.weight.data_ptr()
    assert views[p + "self_attn.q_proj.weight"].untyped_storage().data_ptr() == \
        attn.qkv_proj.weight.untyped_storage().data_ptr()  # a view, not a copy
    out = export_pretrained(model.hf_named_tensors(), model.config, tmp_path / "out", source_dir=folder)
    written = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            written.update({n: fh.get_tensor(n) for n in fh.keys()})
    assert set(written) == set(tensors)
    for name, t in tensors.items():
        assert written[name].dtype == dtype and torch.equal(written[name].view(torch.uint8), t.view(torch.uint8)), name


def test_hf_state_dict_loads_into_fused_parameters():
    torch.manual_seed(0)
    src, dst = SDARForCausalLM(small_cfg(attention_bias=True)), SDARForCausalLM(small_cfg(attention_bias=True))
    hf = {n: t.detach().clone() for n, t in src.hf_named_tensors()}
    dst.load_state_dict(hf)
    assert weights_digest(dst.hf_named_tensors()) == weights_digest(src.hf_named_tensors())
    dst.load_state_dict(src.state_dict())  # the fused layout's own state dict (trainer checkpoints)


@pytest.fixture()
def served_fused_model():
    from server.api import routes_weights
    from server.api.state import ServerState, attach
    from server.weights.weight_updates import WeightUpdates

    torch.manual_seed(0)
    engine = FakeEngine(SDARForCausalLM(small_cfg(attention_bias=True)).eval())
    from fastapi import FastAPI

    app = FastAPI()
    attach(app, ServerState(engine, admin_token=TOKEN, weight_updates=WeightUpdates(engine, keep_versions=2)))
    app.include_router(routes_weights.router)
    with ReceiverServer(app) as srv:
        srv.engine = engine
        yield srv


def _trained(seed: int) -> SDARForCausalLM:
    torch.manual_seed(seed)
    return SDARForCausalLM(small_cfg(attention_bias=True)).eval()


def test_push_into_fused_server_model_in_place_then_rollback(served_fused_model):
    srv = served_fused_model
    served = srv.engine.model
    ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}
    digest0 = srv.get("/weights/checksum")["digest"]
    ids, pos = torch.randint(0, 60, (2, 8)), torch.arange(8).expand(2, 8)
    for version, transport in ((1, "http"), (2, "shm")):
        trained = _trained(version)
        push([srv.url], trained.hf_named_tensors(), version, transport=transport, token=TOKEN)
        assert srv.get("/weights/checksum") == {"version": version, "digest": weights_digest(trained.hf_named_tensors())}
        assert {n: p.data_ptr() for n, p in served.named_parameters()} == ptrs  # copied in place
        with torch.no_grad():
            assert torch.equal(served(ids, pos), trained(ids, pos))
    deadline = 50
    while srv.get("/weights/kept")["versions"] != [1, 2] and deadline:
        import time

        time.sleep(0.1)
        deadline -= 1
    r = httpx.post(srv.url + "/weights/rollback", json={"version": 1},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["digest"] == weights_digest(_trained(1).hf_named_tensors()) != digest0
    assert {n: p.data_ptr() for n, p in served.named_parameters()} == ptrs


def test_zero3_source_sends_fused_parameters_under_hf_names(monkeypatch):
    model = _trained(0)
    fused = model.model.layers[0].self_attn.qkv_proj.weight
    fused.ds_id, fused.ds_shape = 7, fused.shape  # pretend it is a partitioned ZeRO-3 parameter
    gathered = fake_zero3_gather(monkeypatch)
    source = iter_deepspeed_params(types.SimpleNamespace(module=model), gather_bytes=1 << 30)
    specs = source.specs(torch.bfloat16)
    assert [s[0] for s in specs] == [n for n, _ in model.hf_named_tensors()]
    assert [s[2] for s in specs] == [tuple(t.shape) for _, t in model.hf_named_tensors()]
    out = dict(source())
    assert any(id(fused) in g for g in gathered)
    assert weights_digest(out) == weights_digest(model.hf_named_tensors())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_model_on_cuda_matches_cpu_and_loads_in_place():
    cpu = _trained(0)
    cuda = _trained(1).cuda()
    ptr = cuda.model.layers[0].self_attn.qkv_proj.weight.data_ptr()
    from dllm.weights import copy_into_model

    copy_into_model(cuda, cpu.hf_named_tensors())  # HF tensors into the fused CUDA rows
    assert cuda.model.layers[0].self_attn.qkv_proj.weight.data_ptr() == ptr
    assert weights_digest((n, t.cpu()) for n, t in cuda.hf_named_tensors()) == weights_digest(cpu.hf_named_tensors())
    ids, pos = torch.randint(0, 60, (2, 8)), torch.arange(8).expand(2, 8)
    with torch.no_grad():
        assert (cuda(ids.cuda(), pos.cuda()).cpu() - cpu(ids, pos)).abs().max() <= 1e-4
