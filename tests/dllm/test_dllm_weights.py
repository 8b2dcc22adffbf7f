"""Weights I/O: sharded SDAR-format folders round-trip; bad input names the problem."""

import json

import pytest
import torch

from dllm.model import SDARForCausalLM
from dllm.weights import WeightLoadError, copy_into_model, load_pretrained, save_pretrained
from tests.helpers import tiny_config


def test_sharded_round_trip(tmp_path):
    torch.manual_seed(0)
    m = SDARForCausalLM(tiny_config()).eval()
    save_pretrained(m, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    assert "model.layers.1.self_attn.q_norm.weight" in index["weight_map"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "sdar" and cfg["block_size"] == 4 and cfg["mask_token_id"] == 63
    m2 = load_pretrained(tmp_path)
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    ids = torch.randint(0, 63, (1, 8))
    assert torch.equal(m(ids), m2(ids))


def test_bf16_load_and_tied(tmp_path):
    m = SDARForCausalLM(tiny_config(tie_word_embeddings=True))
    save_pretrained(m, tmp_path)
    m2 = load_pretrained(tmp_path, dtype="bfloat16")
    assert m2.lm_head.weight.dtype == torch.bfloat16
    assert m2.lm_head.weight.data_ptr() == m2.model.embed_tokens.weight.data_ptr()


def test_copy_into_model_is_all_or_nothing():
    m = SDARForCausalLM(tiny_config())
    before = {n: p.clone() for n, p in m.state_dict().items()}
    good = [(n, torch.zeros_like(p)) for n, p in m.hf_named_tensors()]
    bad_shape = good[:-1] + [(good[-1][0], torch.zeros(3, 3))]
    with pytest.raises(WeightLoadError, match="shape mismatch"):
        copy_into_model(m, bad_shape)
    with pytest.raises(WeightLoadError, match="unexpected tensor 'nope'"):
        copy_into_model(m, good + [("nope", torch.zeros(1))])
    with pytest.raises(WeightLoadError, match="missing tensor"):
        copy_into_model(m, good[1:])
    assert all(torch.equal(before[n], p) for n, p in m.state_dict().items())
    copy_into_model(m, good)
    assert all(float(p.abs().sum()) == 0 for p in m.parameters())


def test_missing_files_and_bad_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    cfg = tiny_config()
    cfg.save(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type"):
        load_pretrained(tmp_path)


def test_shape_mismatch_on_load(tmp_path):
    save_pretrained(SDARForCausalLM(tiny_config()), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match="shape mismatch for 'model.layers.0.mlp"):
        load_pretrained(tmp_path)
