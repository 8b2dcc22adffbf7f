"""Exports load in transformers like the source checkpoint: AutoModelForCausalLM (trust_remote_code)
gives the same logits, AutoTokenizer the same tokens and template; config.json keeps every source
field, modeling/tokenizer files come along (or the project's own SDAR files for the embedded
default), generation_config.json is written, and the source dtype is kept unless asked."""

import json
from pathlib import Path

import torch

from dllm.export import export_pretrained
from dllm.weights import load_pretrained, save_pretrained


def _hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()


def _hf_tok(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)


def test_export_of_the_embedded_default_loads_in_transformers(tiny_model_dir, tmp_path):
    model = load_pretrained(tiny_model_dir)
    out = export_pretrained(model.hf_named_tensors(), model.config, tmp_path / "out", source_dir=tiny_model_dir)
    names = {p.name for p in out.iterdir()}
    assert {"configuration_sdar.py", "modeling_sdar.py", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "model.safetensors", "config.json"} <= names
    cfg = json.loads((out / "config.json").read_text())
    src = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert {k: cfg[k] for k in src} == src and cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_sdar.SDARForCausalLM"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == model.config.eos_ids
    hf = _hf_model(out)
    ids = torch.randint(0, 60, (2, 13))
    with torch.no_grad():
        # same weights, same maths; fused projections and fewer-op norms round differently (fp32 ulps)
        assert (hf(ids).logits - model(ids)).abs().max() <= 1e-5
        hf_pos = hf(ids[:, :6], position_ids=torch.arange(6, 12).expand(2, 6)).logits
        assert torch.allclose(hf_pos, model(ids[:, :6], torch.arange(6, 12).expand(2, 6)), atol=1e-6)
    assert _hf_tok(out).encode("12+34=") == _hf_tok(tiny_model_dir).encode("12+34=")
    reloaded = load_pretrained(out)  # and dlrl loads its own export
    assert all(torch.equal(a, b) for a, b in zip(reloaded.parameters(), model.parameters()))


def test_export_keeps_source_fields_files_and_dtype(small_sdar_dir, tmp_path):
    src = tmp_path / "src"  # a public-style folder: its own modeling files, bf16, Qwen tokenizer
    first = load_pretrained(small_sdar_dir, dtype="bfloat16")
    export_pretrained(first.hf_named_tensors(), first.config, src, source_dir=small_sdar_dir)
    (src / "modeling_sdar.py").write_text((src / "modeling_sdar.py").read_text() + "\n# the source's own file\n")
    model = load_pretrained(src)  # the trainer holds fp32
    assert model.dtype == torch.float32
    out = export_pretrained(model.hf_named_tensors(), model.config, tmp_path / "out", source_dir=src,
                            max_shard_bytes=8 << 20)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name in ("modeling_sdar.py", "configuration_sdar.py", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    from safetensors import safe_open

    with safe_open(str(out / index["weight_map"]["lm_head.weight"]), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # the source dtype
    ids = torch.randint(0, 151000, (1, 11))
    with torch.no_grad():
        assert torch.equal(_hf_model(out)(ids).logits, _hf_model(src)(ids).logits)
    tok_src, tok_out = _hf_tok(src), _hf_tok(out)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok_out.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok_src.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    asked = export_pretrained(model.hf_named_tensors(), model.config, tmp_path / "fp32", source_dir=src,
                              dtype="float32")
    assert json.loads((asked / "config.json").read_text())["torch_dtype"] == "float32"


def test_export_hf_from_deepspeed_with_source_dir(small_sdar_dir, tmp_path):
    from trainer.infra.ds_engine import DSConfig, build_engine, export_hf

    model = load_pretrained(small_sdar_dir)
    engine = build_engine(model, DSConfig(zero_stage=0, lr=1e-3))
    export_hf(engine, None, tmp_path / "final", source_dir=small_sdar_dir)
    src_cfg = json.loads((Path(small_sdar_dir) / "config.json").read_text())
    assert json.loads((tmp_path / "final" / "config.json").read_text()) == src_cfg
    assert (tmp_path / "final" / "tokenizer.json").is_file() and (tmp_path / "final" / "modeling_sdar.py").is_file()
    back = load_pretrained(tmp_path / "final", dtype="bfloat16")
    ref = load_pretrained(small_sdar_dir, dtype="bfloat16")
    assert all(torch.equal(a, b) for a, b in zip(back.parameters(), ref.parameters()))
    save_pretrained(model, tmp_path / "plain")  # the old path still writes a loadable folder
    assert load_pretrained(tmp_path / "plain").config.block_size == 4
