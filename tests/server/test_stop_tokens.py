"""Chat models stop at <|im_end|>: the server stops at the union of config.json's,
generation_config.json's and the tokenizer's eos ids on every generation route, a request's
stop_token_ids add to them, and the stop token is the last token of the completion and of the
trace. trust_remote_code is an explicit option: loading a folder with custom code never asks (a
`dlrl serve` subprocess on such a folder: tests/trainer/test_eval.py::test_eval_starts_its_own_server...)."""

import builtins
import json
from pathlib import Path

import httpx
import pytest

from dllm.tokenizer import TokenizerLoadError, eos_token_ids, generation_eos_ids, load_tokenizer

IM_END, EOT = 151645, 151643


class _Tok:
    eos_token_id = 7


def test_eos_ids_are_the_union(tmp_path):
    assert generation_eos_ids(tmp_path) == []
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, EOT]}))
    assert eos_token_ids(tmp_path, _Tok(), [EOT]) == [7, EOT, IM_END]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert eos_token_ids(tmp_path, None, [5, 9]) == [5, 9]
    (tmp_path / "generation_config.json").write_text("{not json")
    assert eos_token_ids(tmp_path, None, []) == []


def _check_stop(completion_ids, trace, text):
    assert completion_ids[-1] in (IM_END, EOT) and not set(completion_ids[:-1]) & {IM_END, EOT}
    assert len(trace["steps"]) == len(trace["logprobs"]) == len(completion_ids)  # the stop token is traced
    assert "<|im_end|>" not in text


def test_every_route_stops_at_im_end(small_sdar_dir, make_server_for):
    srv = make_server_for(small_sdar_dir, max_model_len=256)
    assert srv.engine.backend.eos_ids == [EOT, IM_END]  # config.json lists only <|endoftext|>
    body = {"max_tokens": 24, "temperature": 1.0, "seed": 3, "n": 3}
    samples = httpx.post(srv.url + "/generate", json={**body, "prompt": "What is 2+2?"}, timeout=60).json()["samples"]
    stopped = [s for s in samples if s["finish_reason"] == "stop"]
    assert any(s["completion_ids"][-1] == IM_END for s in stopped)
    for s in stopped:
        _check_stop(s["completion_ids"], s["trace"], s["text"])
    comp = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": "Hi", "return_trace": True},
                      timeout=60).json()["choices"]
    # the random model ends about 2 turns in 3 within 24 tokens: of 8 samples one stops all but surely
    chat = httpx.post(srv.url + "/v1/chat/completions", json={**body, "n": 8, "return_trace": True, "messages": [
        {"role": "user", "content": "What is 2+2?"}]}, timeout=60).json()["choices"]
    for c in comp + chat:
        if c["finish_reason"] == "stop":
            _check_stop(c["completion_ids"], c["trace"], c.get("text") or c["message"]["content"])
    assert any(c["finish_reason"] == "stop" and c["completion_ids"][-1] == IM_END for c in chat)


def test_request_stop_token_ids_add_to_the_eos_ids(small_sdar_dir, make_server_for):
    srv = make_server_for(small_sdar_dir, max_model_len=256)
    base = {"prompt": "Count:", "max_tokens": 40, "temperature": 1.0, "seed": 11}
    free = httpx.post(srv.url + "/generate", json={**base, "ignore_eos": True}, timeout=60).json()["samples"][0]
    ids = free["completion_ids"]
    stop_id = next(t for t in ids[1:] if t not in (IM_END, EOT))
    stops = {stop_id, IM_END, EOT}
    first = next(i for i, t in enumerate(ids) if t in stops)
    for route, extra in (("/generate", {}), ("/v1/completions", {"return_trace": True})):
        r = httpx.post(srv.url + route, json={**base, **extra, "stop_token_ids": [stop_id]}, timeout=60).json()
        got = (r.get("samples") or r.get("choices"))[0]
        assert got["finish_reason"] == "stop" and got["completion_ids"] == ids[:first + 1]


def _custom_code_folder(tmp_path: Path, tiny_model_dir: str) -> Path:
    """An exported tiny model: config.json with auto_map + configuration/modeling code."""
    from dllm.export import export_pretrained
    from dllm.weights import load_pretrained

    model = load_pretrained(tiny_model_dir)
    return export_pretrained(model.hf_named_tensors(), model.config, tmp_path / "custom", source_dir=tiny_model_dir)


def test_custom_code_never_prompts(tiny_model_dir, tmp_path, monkeypatch):
    folder = _custom_code_folder(tmp_path, tiny_model_dir)
    assert json.loads((folder / "config.json").read_text())["auto_map"]

    def no_prompt(*a, **k):
        raise AssertionError("asked on stdin")

    monkeypatch.setattr(builtins, "input", no_prompt)
    assert load_tokenizer(folder).encode("1+2=") == load_tokenizer(tiny_model_dir).encode("1+2=")
    assert load_tokenizer(folder, trust_remote_code=True).encode("1+2=")  # runs the folder's config code
    # a tokenizer that only exists as the folder's code: refused with the option to set, or run when asked
    (folder / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="CustomTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerLoadError, match="trust_remote_code"):
        load_tokenizer(folder)
    assert type(load_tokenizer(folder, trust_remote_code=True)).__name__ == "CustomTokenizer"
