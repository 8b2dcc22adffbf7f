"""Full-attention models (LLaDA, Dream): official-layout tiny folders, family detection, streaming load,
export back to the official layout, the bidirectional forward, Dream's logit shift, padding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dllm.config import ConfigValueError
from dllm.embedded.full_folders import build_full_folder, tokenizer_vocab
from dllm.full.config import FullAttentionConfig, detect_family
from dllm.full.load import save_full_pretrained
from dllm.full.model import FullAttentionLM
from dllm.tokenizer import load_tokenizer
from dllm.weights import copy_into_model, load_pretrained

LLADA_NAMES = ["model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"] + [
    f"model.transformer.blocks.0.{n}.weight" for n in
    ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")]
DREAM_NAMES = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
    f"model.layers.0.{n}" for n in
    ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
     "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
     "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("full")
    return {f: build_full_folder(root / f, f) for f in ("llada", "dream")}


def _names(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return {n: tuple(fh.get_slice(n).get_shape()) for n in fh.keys()}


def test_llada_folder_is_the_official_layout(folders: dict[str, Path]) -> None:
    f = folders["llada"]
    cfg = json.loads((f / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["architectures"] == ["LLaDAModelLM"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_llada.LLaDAModelLM"
    for k in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "embedding_size", "weight_tying",
              "rope_theta", "block_type", "layer_norm_type", "mask_token_id", "eos_token_id", "pad_token_id"):
        assert k in cfg, k
    assert "block_size" not in cfg and cfg["rope_theta"] == 500000.0 and cfg["n_heads"] == cfg["n_kv_heads"]
    names = _names(f)
    assert set(LLADA_NAMES) <= set(names)
    d, h = cfg["d_model"], cfg["mlp_hidden_size"]
    assert names["model.transformer.blocks.0.ff_proj.weight"] == (h, d)
    assert names["model.transformer.blocks.0.ff_out.weight"] == (d, h)
    assert names["model.transformer.ff_out.weight"] == (cfg["embedding_size"], d)
    tok = load_tokenizer(f)
    assert tok.convert_tokens_to_ids("<|mdm_mask|>") == cfg["mask_token_id"]
    assert tok.convert_tokens_to_ids("<|endoftext|>") == cfg["eos_token_id"] == cfg["pad_token_id"]
    gen = json.loads((f / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|eot_id|>") in gen["eos_token_id"]


def test_dream_folder_is_the_official_layout(folders: dict[str, Path]) -> None:
    f = folders["dream"]
    cfg = json.loads((f / "config.json").read_text())
    assert cfg["model_type"] == "Dream" and cfg["architectures"] == ["DreamModel"]
    assert cfg["auto_map"]["AutoModel"] == "modeling_dream.DreamModel"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    names = _names(f)
    assert set(DREAM_NAMES) <= set(names)
    assert not any("q_norm" in n or "k_norm" in n for n in names)  # Qwen2: no QK norms
    tok = load_tokenizer(f)
    assert tok.convert_tokens_to_ids("<|mask|>") == cfg["mask_token_id"]
    assert tok.convert_tokens_to_ids("<|endoftext|>") == cfg["pad_token_id"]
    gen = json.loads((f / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                              add_generation_prompt=True)


@pytest.mark.parametrize("d, family", [
    ({"model_type": "llada"}, "llada"), ({"model_type": "Dream"}, "dream"), ({"model_type": "sdar"}, "sdar"),
    ({"architectures": ["LLaDAModelLM"]}, "llada"), ({"auto_map": {"AutoModel": "modeling_dream.DreamModel"}}, "dream"),
])
def test_family_detection_reads_fields_only(d: dict, family: str) -> None:
    assert detect_family(d) == family


def test_unknown_family_and_unsupported_maths_name_the_field(folders: dict[str, Path]) -> None:
    with pytest.raises(ConfigValueError, match="model_type"):
        detect_family({"model_type": "gpt2"})
    cfg = json.loads((folders["llada"] / "config.json").read_text())
    for field, value in (("alibi", True), ("layer_norm_type", "default"), ("scale_logits", True),
                         ("block_type", "sequential"), ("n_heads", 5)):
        with pytest.raises(ConfigValueError, match=field):
            FullAttentionConfig.from_dict({**cfg, field: value})
    dream = json.loads((folders["dream"] / "config.json").read_text())
    with pytest.raises(ConfigValueError, match="rope_scaling"):
        FullAttentionConfig.from_dict({**dream, "rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ConfigValueError, match="mask_token_id"):
        FullAttentionConfig.from_dict({**dream, "mask_token_id": 10_000})


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_load_dispatches_and_exports_the_same_layout(folders: dict[str, Path], family: str, tmp_path: Path) -> None:
    src = folders[family]
    model = load_pretrained(src, block_size=8)
    assert isinstance(model, FullAttentionLM) and model.attention == "full" and model.family == family
    assert model.config.block_size == 8 and model.dtype == torch.float32
    assert model.config.mask_token_id == json.loads((src / "config.json").read_text())["mask_token_id"]
    ids = torch.randint(0, 90, (2, 9))
    ref = model(ids)
    out = save_full_pretrained(model, tmp_path / "out", source_dir=src)
    assert _names(out) == _names(src)
    a, b = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {k: v for k, v in b.items() if k != "block_size"} == a  # every official field kept, auto_map included
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    again = load_pretrained(out)
    torch.testing.assert_close(again(ids), ref, rtol=0, atol=0)
    bf = load_pretrained(src, dtype="bf16")
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf(ids).float(), ref, atol=0.05, rtol=0.05)


def test_weight_copy_uses_official_names(folders: dict[str, Path]) -> None:
    a, b = load_pretrained(folders["dream"]), load_pretrained(folders["dream"])
    with torch.no_grad():
        for _, p in b.hf_named_tensors():
            p.add_(0.01)
    copied = copy_into_model(a, [(n, t.detach().clone()) for n, t in b.hf_named_tensors()])
    assert copied == set(DREAM_NAMES) | {n for n, _ in a.hf_named_tensors()}
    ids = torch.randint(0, 90, (1, 7))
    torch.testing.assert_close(a(ids), b(ids), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bidirectional_padding_and_shift(folders: dict[str, Path], family: str) -> None:
    model = load_pretrained(folders[family])
    ids = torch.randint(0, 90, (1, 8))
    logits = model(ids)
    later = ids.clone()
    later[0, -1] = (later[0, -1] + 1) % 90
    assert not torch.allclose(model(later)[0, 1], logits[0, 1])  # an earlier position sees a later token
    padded = torch.cat([ids, torch.full((1, 3), model.config.mask_token_id)], 1)
    valid = torch.ones(1, 11, dtype=torch.bool)
    valid[0, 8:] = False
    torch.testing.assert_close(model(padded, valid=valid)[:, :8], logits, atol=1e-5, rtol=1e-5)
    hidden = model.hidden_states(ids, torch.arange(8)[None])[0]
    shifted = torch.cat([hidden[:, :1], hidden[:, :-1]], 1) if family == "dream" else hidden
    torch.testing.assert_close(model.lm_head(shifted), logits, atol=0, rtol=0)
    assert model.config.logit_shift == (1 if family == "dream" else 0)


def test_tied_llada_has_no_output_tensor(tmp_path: Path) -> None:
    f = build_full_folder(tmp_path / "tied", "llada", tie_word_embeddings=True)
    assert "model.transformer.ff_out.weight" not in _names(f)
    model = load_pretrained(f)
    ids = torch.randint(0, 90, (1, 5))
    hidden = model(ids, output="hidden")
    torch.testing.assert_close(model(ids), hidden @ model.model.transformer.wte.weight.T)  # type: ignore[union-attr]
    assert len(tokenizer_vocab("llada")) <= model.config.vocab_size


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_export_pretrained_writes_the_official_layout(folders: dict[str, Path], family: str, tmp_path: Path) -> None:
    from dllm.export import export_pretrained

    model = load_pretrained(folders[family])
    out = export_pretrained(model.hf_named_tensors(), model.config, tmp_path / "exp", dtype="bf16")
    data = json.loads((out / "config.json").read_text())
    src = json.loads((folders[family] / "config.json").read_text())
    assert data["auto_map"] == src["auto_map"] and data["torch_dtype"] == "bfloat16"
    assert not (out / "modeling_sdar.py").exists() and (out / "generation_config.json").is_file()
    assert _names(out) == _names(folders[family])
    again = load_pretrained(out)
    assert again.config.torch_dtype == "bfloat16" and again.config.family == family


def test_real_ids_folder_has_the_published_special_ids(tmp_path: Path) -> None:
    from dllm.embedded.full_folders import PUBLISHED, REAL_IDS

    f = build_full_folder(tmp_path / "real", "llada", real_ids=True, dtype=torch.bfloat16, num_hidden_layers=1,
                          vocab_size=PUBLISHED["llada"]["vocab_size"])
    cfg = json.loads((f / "config.json").read_text())
    assert (cfg["mask_token_id"], cfg["eos_token_id"], cfg["vocab_size"]) == (126336, 126081, 126464)
    tok = load_tokenizer(f)
    assert all(tok.convert_tokens_to_ids(t) == i for t, i in REAL_IDS["llada"].items())
    model = load_pretrained(f, dtype="bf16")
    assert model(torch.tensor([[5, 126080, 126346]])).shape == (1, 3, 126464)
