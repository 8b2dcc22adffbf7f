"""Tokenizers: any Hugging Face tokenizer folder, or the built-in character-level one.

    tok = build_char_tokenizer("runs/tiny-sft")     # writes tokenizer.json + tokenizer_config.json
    tok = load_tokenizer("runs/tiny-sft")           # AutoTokenizer, works for SDAR folders too

The character tokenizer is made with the `tokenizers` library (one token per
character, plus special tokens), loads with `transformers.AutoTokenizer`, and has a
Qwen-style chat template.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

EOS, MASK, IM_START, IM_END, UNK = "<|endoftext|>", "<|MASK|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = [EOS, MASK, IM_START, IM_END, UNK]
CHARS = string.digits + "+-*/=()., :?\n" + string.ascii_letters + "!\"#$%&'<>@[\\]^_`{|}~;"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer(out_dir: str | Path, chars: str = CHARS):
    """Create, save and return the character-level tokenizer (specials get ids 0..4)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS, "pad_token": EOS, "mask_token": MASK, "unk_token": UNK,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    return load_tokenizer(out)


def load_tokenizer(path: str | Path):
    """Load a tokenizer folder with AutoTokenizer (no network)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    p = Path(path)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json / tokenizer_config.json in {p}")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # AutoTokenizer warns about the unknown "sdar" config type
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    finally:
        hf_logging.set_verbosity(level)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)
