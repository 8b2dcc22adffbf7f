"""Public SDAR/TraDo folders load as they are: every field of the SDAR-1.7B-Chat config.json is
understood or knowingly ignored, the maths matches transformers' Qwen3 (block size 1), missing
block_size/mask_token_id come from options or the tokenizer, bad folders fail naming the field
or file, and loading streams shard by shard (peak RSS measured in a subprocess)."""

import json
import logging
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dllm.config import IGNORED_FIELDS, ConfigValueError, SDARConfig, load_model_config
from dllm.weights import WeightLoadError, copy_into_model, empty_model, load_pretrained
from tests.helpers import FIXTURE_CONFIG

FIXTURE = json.loads(Path(FIXTURE_CONFIG).read_text())


def test_every_fixture_field_is_understood_or_knowingly_ignored(caplog):
    names = set(SDARConfig.__dataclass_fields__) - {"extra"}
    assert set(FIXTURE) <= names | set(IGNORED_FIELDS), set(FIXTURE) - names - set(IGNORED_FIELDS)
    with caplog.at_level(logging.WARNING, logger="dlrl.model"):
        cfg = SDARConfig.from_dict(FIXTURE)
    assert not caplog.records  # nothing unknown, nothing refused
    assert (cfg.block_size, cfg.mask_token_id, cfg.eos_ids, cfg.rope_theta, cfg.head_dim) == (4, 151669, [151643],
                                                                                              1e6, 128)
    assert cfg.torch_dtype == "bfloat16" and cfg.extra["auto_map"] == FIXTURE["auto_map"]
    assert cfg.to_dict() == {**FIXTURE, "rope_theta": 1e6, "pad_token_id": None}  # written back as read


def test_fixture_config_matches_transformers_qwen3_with_block_size_1():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    data = {**FIXTURE, "num_hidden_layers": 1}
    cfg = SDARConfig.from_dict(data, block_size=1)  # every other field as published
    torch.manual_seed(0)
    ours = empty_model(cfg, "cpu", torch.float32).eval()
    with torch.no_grad():  # random rows; vocabulary-sized matrices repeat 997 random rows (fast)
        for name, p in ours.hf_named_tensors():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            rows = torch.randn(min(p.shape[0], 997), *p.shape[1:]) * 0.02
            for i in range(0, p.shape[0], len(rows)):
                p[i:i + len(rows)] = rows[:p.shape[0] - i]
    qwen_fields = {k: v for k, v in data.items() if k not in ("auto_map", "architectures", "model_type")}
    with torch.device("meta"):
        ref = Qwen3ForCausalLM(Qwen3Config(**{**qwen_fields, "attn_implementation": "eager"}))
    ref.load_state_dict(dict(ours.hf_named_tensors(remove_duplicate=False)), assign=True)  # shared: no copy
    ref.model.rotary_emb = type(ref.model.rotary_emb)(config=ref.config)  # its buffer was on meta
    ids = torch.randint(0, 151000, (2, 9))
    with torch.no_grad():
        diff = (ours(ids) - ref.eval()(ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def _folder(tmp_path: Path, src: str, **changes) -> Path:
    out = tmp_path / "m"
    shutil.copytree(src, out)
    data = json.loads((out / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    (out / "config.json").write_text(json.dumps(data))
    return out


def test_missing_block_size_and_mask_from_options_and_tokenizer(small_sdar_dir, tmp_path, caplog):
    folder = _folder(tmp_path, small_sdar_dir, block_size=None, mask_token_id=None)
    with pytest.raises(ConfigValueError, match="block_size: missing from config.json"):
        load_pretrained(folder)
    with caplog.at_level(logging.INFO, logger="dlrl.model"):
        model = load_pretrained(folder, block_size=4)
    assert model.config.block_size == 4 and model.config.mask_token_id == 151669
    logged = caplog.text
    assert "block_size" in logged and "using 4 from the options" in logged
    assert "mask_token_id" in logged and "<|MASK|>" in logged
    assert load_model_config(folder, block_size=8, mask_token_id=151668).mask_token_id == 151668
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigValueError, match="mask_token_id: missing"):
        load_model_config(folder, block_size=4)


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_parameters"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    ({"use_sliding_window": None, "sliding_window": 4096}, "sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts": 8}, "num_experts"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"hidden_size": None}, "hidden_size"),
    ({"block_size": 3}, "block_size"),
])
def test_bad_configs_name_the_field(small_sdar_dir, tmp_path, changes, field):
    folder = _folder(tmp_path, small_sdar_dir, **changes)
    with pytest.raises(ConfigValueError, match=f"^{field}: "):
        load_pretrained(folder)


def test_default_rope_scaling_and_new_rope_layout_load(small_sdar_dir, tmp_path):
    folder = _folder(tmp_path, small_sdar_dir, rope_scaling={"rope_type": "default"}, rope_theta=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert load_model_config(folder).rope_theta == 5e5


def test_bad_weight_files_name_the_file_or_tensor(small_sdar_dir, tmp_path):
    folder = _folder(tmp_path, small_sdar_dir)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).rename(folder / "moved.safetensors")
    with pytest.raises(FileNotFoundError, match=shard):
        load_pretrained(folder)
    (folder / "moved.safetensors").write_bytes(b"not safetensors")
    (folder / "moved.safetensors").rename(folder / shard)
    with pytest.raises(WeightLoadError, match=shard):
        load_pretrained(folder)
    folder2 = _folder(tmp_path / "b", small_sdar_dir, intermediate_size=96)
    with pytest.raises(WeightLoadError, match="shape mismatch for 'model.layers.0.mlp"):
        load_pretrained(folder2)


def test_streamed_copy_validates_first_and_reads_one_tensor_at_a_time(small_sdar_dir):
    model = load_pretrained(small_sdar_dir)
    params = dict(model.hf_named_tensors())
    specs = [(n, tuple(p.shape)) for n, p in params.items()]
    copied = []

    def stream():
        for name, p in params.items():
            if copied:  # the previous tensor is already in the model when the next one is read
                assert torch.equal(params[copied[-1]], torch.full_like(params[copied[-1]], 0.5))
            copied.append(name)
            yield name, torch.full_like(p, 0.5)

    copy_into_model(model, stream(), specs=specs)
    assert len(copied) == len(params)
    with pytest.raises(WeightLoadError, match="shape mismatch"):  # specs checked before reading anything
        copy_into_model(model, (x for x in ()), specs=specs[:-1] + [(specs[-1][0], (1,))])


RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    from dllm.config import SDARConfig
    from dllm.weights import empty_model, load_pretrained
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    empty_model(SDARConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                           num_key_value_heads=1, head_dim=8, mask_token_id=1))  # torch's lazy meta-device imports
    before = status("VmRSS:")
    model = load_pretrained(sys.argv[1])
    peak = status("VmHWM:")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"before": before, "peak": peak, "size": size,
                      "probe": float(model.lm_head.weight[7, 3])}))
""")


@pytest.mark.slow
def test_streaming_load_peak_rss_of_a_500mb_model(tmp_path):
    from dllm.embedded.standin import write_random_weights

    cfg = SDARConfig(vocab_size=16384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=7,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=64, block_size=4, mask_token_id=1,
                     torch_dtype="float32")
    cfg.save(tmp_path)
    write_random_weights(tmp_path, cfg, dtype=torch.float32, max_shard_bytes=64 << 20)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert 450e6 < r["size"] < 560e6
    growth = r["peak"] - r["before"]
    assert growth < 1.3 * r["size"], f"peak grew by {growth / 1e6:.0f} MB for a {r['size'] / 1e6:.0f} MB model"
    from safetensors import safe_open

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    with safe_open(str(tmp_path / index["weight_map"]["lm_head.weight"]), "pt") as f:
        assert r["probe"] == float(f.get_tensor("lm_head.weight")[7, 3])


def test_dlrl_serve_names_the_field_of_a_bad_folder(small_sdar_dir, tmp_path, capsys):
    from server.cli import main as serve_main

    folder = _folder(tmp_path, small_sdar_dir, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(SystemExit) as e:
        serve_main(["--model", str(folder), "server.device=cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "rope_scaling: rope type 'yarn' is not implemented" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit):
        serve_main(["--model", str(folder), "server.block_size=-1"])
    assert "server.block_size" in capsys.readouterr().err
