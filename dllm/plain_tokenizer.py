"""PlainTokenizer: a self-contained `tokenizers` folder, served without importing transformers.

    if PlainTokenizer.fits(folder):                 # dllm.tokenizer.load_tokenizer decides
        tok = PlainTokenizer(folder)
    tok.encode("2+3=", add_special_tokens=False); tok.decode(ids, skip_special_tokens=True)
    tok.eos_token_id, tok.mask_token_id, tok.all_special_ids, len(tok), tok.backend_tokenizer
    tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)   # transformers, on first use

`import transformers` builds its registry of every model family on each import: ~1.3 s of CPU in every
process that loads a tokenizer (the engine core, each API process, each trainer rank: benchmarks/startup.py).
A folder whose tokenizer_config.json names `PreTrainedTokenizerFast` and whose tokenizer.json already holds
everything that class would set up (`fits`: every named special token is a special added token, no
post-processor, no truncation or padding, no extra options) loads here as that class would load it: the same
`tokenizers.Tokenizer`, untouched, so encode / decode / ids are that library's, as they are under
transformers (tests/dllm/test_plain_tokenizer.py compares the two on every method here). Anything else
(remote code, slow tokenizers, options transformers rewrites the backend for) loads through transformers as
before. The chat template is rendered by transformers' own tokenizer for the folder, loaded on first use, so
templates render exactly as they always have; the processes that never render one never import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")  # transformers'
# order (SPECIAL_TOKENS_ATTRIBUTES)
EXTRA = ("additional_special_tokens", "extra_special_tokens")
# tokenizer_config.json keys that only describe what the tokenizer.json already holds, or that no method here reads
PLAIN_KEYS = frozenset({"tokenizer_class", *NAMED, *EXTRA, "chat_template", "model_max_length",
                        "clean_up_tokenization_spaces", "padding_side", "truncation_side", "model_input_names"})


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a tokenizer folder; {} when it is absent, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _named(name: str) -> tuple[property, property]:
    """The properties of a named special token (tokenizer_config.json's `name`): the token, its id."""
    return property(lambda self: self._named.get(name)), property(lambda self: self._id(name))


class PlainTokenizer:
    """The `PreTrainedTokenizerFast` of a self-contained folder (`fits`), on the `tokenizers` library alone."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = str(folder)
        self._folder = Path(folder)
        config = read_json(self._folder / "tokenizer_config.json")
        self._tokenizer: Tokenizer = Tokenizer.from_file(str(self._folder / "tokenizer.json"))
        self._named: dict[str, str] = {k: config[k] for k in NAMED if isinstance(config.get(k), str)}
        self._extra: list[str] = next((list(config[k]) for k in EXTRA if config.get(k)), [])
        self.chat_template: str | None = config.get("chat_template")
        self.model_max_length: int = int(config.get("model_max_length", 10**30))
        self._hf: PreTrainedTokenizerFast | None = None

    @staticmethod
    def fits(folder: str | Path) -> bool:
        """True when transformers' PreTrainedTokenizerFast would load the folder's tokenizer.json as it is."""
        folder = Path(folder)
        config, data = read_json(folder / "tokenizer_config.json"), read_json(folder / "tokenizer.json")
        if (config.get("tokenizer_class") != "PreTrainedTokenizerFast" or not data or set(config) - PLAIN_KEYS
                or config.get("clean_up_tokenization_spaces") or (folder / "special_tokens_map.json").exists()
                or (folder / "added_tokens.json").exists()):
            return False
        if data.get("post_processor") or data.get("truncation") or data.get("padding"):
            return False  # transformers rebuilds or reads these
        specials = {t.get("content") for t in data.get("added_tokens") or [] if isinstance(t, dict) and t.get("special")}
        named = [config[k] for k in NAMED if k in config]
        extra = [t for k in EXTRA for t in (config.get(k) or [])]
        tokens = named + extra
        vocab = (data.get("model") or {}).get("vocab")
        return (all(isinstance(t, str) and t in specials for t in tokens)  # nothing for transformers to add
                and isinstance(vocab, dict) and len(vocab) <= 100_000)  # (it patches some larger pre-tokenizers)

    # -- the backend ---------------------------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def is_fast(self) -> bool:
        return True

    def __len__(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    @overload
    def convert_tokens_to_ids(self, tokens: str) -> int | None: ...
    @overload
    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]: ...

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A token's id; the unknown token's id (None without one) for a token not in the vocabulary."""
        if isinstance(tokens, str):
            found = self._tokenizer.token_to_id(tokens)
            return self._id("unk_token") if found is None else int(found)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(i) for i in ids]

    # -- special tokens ------------------------------------------------------------------------------------
    def _id(self, name: str) -> int | None:
        """The id of a named special token (None when the folder names none); a token not in the vocabulary gets
        the unknown token's id, as transformers answers (None without one)."""
        token = self._named.get(name)
        found = None if token is None else self._tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
        return None if token is None or name == "unk_token" else self._id("unk_token")

    bos_token, bos_token_id = _named("bos_token")
    eos_token, eos_token_id = _named("eos_token")
    unk_token, unk_token_id = _named("unk_token")
    pad_token, pad_token_id = _named("pad_token")
    mask_token, mask_token_id = _named("mask_token")

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens in transformers' order, then the extra ones, each once."""
        return list(dict.fromkeys([*(self._named[k] for k in NAMED if k in self._named), *self._extra]))

    @property
    def all_special_ids(self) -> list[int | None]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # -- chat template: transformers' own rendering ---------------------------------------------------------
    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """transformers' `apply_chat_template` for this folder (its tokenizer loaded on first use)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast.from_pretrained(self.name_or_path, local_files_only=True)
        return self._hf.apply_chat_template(conversation, **kwargs)

    def __repr__(self) -> str:
        return f"PlainTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"
