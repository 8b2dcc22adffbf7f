"""Tokenizers: any Hugging Face tokenizer folder, or the built-in character-level one.

    tok = build_char_tokenizer("runs/tiny-sft")     # writes tokenizer.json + tokenizer_config.json
    tok = load_tokenizer("runs/tiny-sft")           # a PlainTokenizer here; AutoTokenizer for SDAR folders
    tok = load_tokenizer(folder, trust_remote_code=True)   # only when asked: never a prompt
    eos = eos_token_ids(folder, tok, cfg.eos_ids)   # config + generation_config.json + tokenizer

The character tokenizer is made with the `tokenizers` library (one token per
character, plus special tokens), loads as `transformers.AutoTokenizer` loads it (as a
PlainTokenizer: dllm/plain_tokenizer.py, without importing transformers), and has a
Qwen-style chat template. The Qwen byte-level BPE stand-in is in dllm/embedded/standin.py.
`find_token_id` reads a special token's id from the tokenizer files without loading it.
"""

from __future__ import annotations

import json
import logging
import string
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from dllm.plain_tokenizer import PlainTokenizer, read_json

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EOS, MASK, IM_START, IM_END, UNK = "<|endoftext|>", "<|MASK|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = [EOS, MASK, IM_START, IM_END, UNK]
CHARS = string.digits + "+-*/=()., :?\n" + string.ascii_letters + "!\"#$%&'<>@[\\]^_`{|}~;"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
log = logging.getLogger("dlrl.model")


class TokenizerLoadError(ValueError):
    """A tokenizer folder cannot be loaded; the message names the file or option."""


def build_char_tokenizer(out_dir: str | Path, chars: str = CHARS) -> PreTrainedTokenizerBase | PlainTokenizer:
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


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase | PlainTokenizer:
    """Load a tokenizer folder as AutoTokenizer does (no network, never a prompt on stdin).

    A self-contained `PreTrainedTokenizerFast` folder (the character tokenizer, the LLaDA / Dream stand-ins,
    many exports) loads as a PlainTokenizer, without importing transformers (dllm.plain_tokenizer); any other
    folder through AutoTokenizer. A folder whose tokenizer needs its own Python code loads only with
    `trust_remote_code=True`; otherwise a TokenizerLoadError says which option to set."""
    p = Path(path)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json / tokenizer_config.json in {p}")
    if PlainTokenizer.fits(p):
        return PlainTokenizer(p)
    from transformers.utils import logging as hf_logging

    if _plain_fast(p):  # what AutoTokenizer would pick, without its registry of every model (~2.5 s of CPU)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
    from transformers import AutoTokenizer, PretrainedConfig

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # AutoTokenizer warns about the unknown "sdar" config type
    try:  # an explicit bool: transformers asks on stdin only when it is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            # an empty config: AutoTokenizer would otherwise parse config.json with transformers'
            # rules (and run its auto_map code); the tokenizer files alone say what to load
            return AutoTokenizer.from_pretrained(str(p), config=PretrainedConfig(), local_files_only=True,
                                                 trust_remote_code=bool(trust_remote_code))
    except ValueError as e:
        if "trust_remote_code" in str(e) or "custom code" in str(e):
            raise TokenizerLoadError(f"trust_remote_code: the tokenizer in {p} needs the folder's own Python "
                                     "code; set trust_remote_code=true to run it (off by default)") from None
        raise
    finally:
        hf_logging.set_verbosity(level)


def _plain_fast(folder: Path) -> bool:
    """The folder names `PreTrainedTokenizerFast` itself and has its tokenizer.json, with options that
    transformers applies to the backend (PlainTokenizer.fits is False): AutoTokenizer would resolve to that
    class and call its from_pretrained; importing AutoTokenizer loads transformers' registry of every model
    family first. Remote code (`auto_map`) keeps the AutoTokenizer path and its trust_remote_code check."""
    config = read_json(folder / "tokenizer_config.json")
    return (config.get("tokenizer_class") == "PreTrainedTokenizerFast" and "auto_map" not in config
            and (folder / "tokenizer.json").is_file())


def encode(tokenizer: PreTrainedTokenizerBase | PlainTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def find_token_id(folder: str | Path, token: str) -> int | None:
    """Id of `token` from the tokenizer files of `folder` (tokenizer.json added tokens and
    vocab, tokenizer_config.json added_tokens_decoder, added_tokens.json), None if absent."""
    folder = Path(folder)
    tj = read_json(folder / "tokenizer.json")
    for added in tj.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return added["id"]
    decoder = read_json(folder / "tokenizer_config.json").get("added_tokens_decoder") or {}
    for idx, added in decoder.items():
        if isinstance(added, dict) and added.get("content") == token and str(idx).isdigit():
            return int(idx)
    for vocab in (read_json(folder / "added_tokens.json"), (tj.get("model") or {}).get("vocab")):
        if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
            return vocab[token]
    return None


def generation_eos_ids(folder: str | Path) -> list[int]:
    """`eos_token_id` of generation_config.json (an int or a list), [] when absent."""
    eos = read_json(Path(folder) / "generation_config.json").get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        return [eos]
    if isinstance(eos, list):
        return [e for e in eos if isinstance(e, int) and not isinstance(e, bool)]
    return []


def eos_token_ids(folder: str | Path | None, tokenizer: PreTrainedTokenizerBase | PlainTokenizer | None, config_eos: list[int]) -> list[int]:
    """The ids that end a generation: the union of config.json's `eos_token_id`,
    generation_config.json's (chat checkpoints list `<|im_end|>` there) and the tokenizer's
    eos token. Sorted, without duplicates."""
    ids = set(config_eos)
    if folder is not None:
        ids.update(generation_eos_ids(folder))
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return sorted(ids)
