"""The Qwen2/Qwen3-style stand-in tokenizer: Qwen's special-token ids, byte-level BPE, and a chat
template that gives, through transformers.AutoTokenizer, exactly the ChatML text Qwen chat models
are trained on (written out by hand below); the server's chat route tokenises the same way."""

import httpx
import pytest

from dllm.tokenizer import find_token_id, load_tokenizer

QWEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
            "<think>": 151667, "</think>": 151668, "<|MASK|>": 151669}


def test_special_tokens_ids_and_byte_level_round_trip(qwen_tokenizer_dir):
    tok = load_tokenizer(qwen_tokenizer_dir)
    assert type(tok).__name__ == "Qwen2Tokenizer" and len(tok) == 151670
    for text, tid in QWEN_IDS.items():
        assert tok.convert_tokens_to_ids(text) == tid == find_token_id(qwen_tokenizer_dir, text)
    assert (tok.eos_token, tok.pad_token, tok.mask_token_id) == ("<|im_end|>", "<|endoftext|>", 151669)
    text = "Héllo wörld, 你好 🙂!\n\n  def f(x):\treturn x**2  # 3.14"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and max(ids) < 151643
    turn = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert turn[0] == 151644 and turn[-1] == 151645
    assert tok.decode([151644, 151645, 151669], skip_special_tokens=True) == ""
    assert isinstance(tok.decode(list(range(151000, 151643, 7))), str)  # every regular id decodes


CASES = [
    ([{"role": "user", "content": "What is 2+2?"}], True, {},
     "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], True, {},
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"},
      {"role": "user", "content": "and 2+2?"}], False, {},
     "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\nand 2+2?<|im_end|>\n"),
    ([{"role": "user", "content": "x"}], True, {"enable_thinking": False},
     "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ([{"role": "user", "content": "call it"}, {"role": "tool", "content": "42"}], True, {},
     "<|im_start|>user\ncall it<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
     "<|im_start|>assistant\n"),
]


@pytest.mark.parametrize("messages, add_gen, extra, expected", CASES)
def test_chat_template_through_transformers_is_qwen_chatml(qwen_tokenizer_dir, messages, add_gen, extra, expected):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir, local_files_only=True)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen, **extra)
    assert text == expected
    ours = load_tokenizer(qwen_tokenizer_dir)  # dlrl's loader: same object kind, same template
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen, **extra) == expected
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_gen, **extra)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == ours.encode(expected, add_special_tokens=False)
    assert ids[0] == QWEN_IDS["<|im_start|>"]


def test_server_chat_route_uses_the_template(small_sdar_dir, make_server_for):
    srv = make_server_for(small_sdar_dir)
    tok = load_tokenizer(small_sdar_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0},
                   timeout=60).json()
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["usage"]["prompt_tokens"] == len(tok.encode(expected, add_special_tokens=False))
    g = httpx.post(srv.url + "/generate", json={"prompt": expected, "max_tokens": 4, "temperature": 0},
                   timeout=60).json()["samples"][0]
    assert g["prompt_ids"][:1] == [QWEN_IDS["<|im_start|>"]] and len(g["prompt_ids"]) == r["usage"]["prompt_tokens"]
