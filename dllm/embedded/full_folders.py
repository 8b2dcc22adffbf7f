"""Random-weight LLaDA and Dream folders in the official layouts, built locally (tests, the tiny default).

    build_llada_folder("runs/tiny-llada")                  # config.json, generation_config.json, tokenizer, weights
    build_dream_folder("runs/tiny-dream", hidden_size=48)  # any config field can be overridden
    tok = build_family_tokenizer("runs/x", "llada")        # the tokenizer alone

Each folder holds what the published checkpoints hold (GSAI-ML/LLaDA-8B-Instruct, Dream-org/Dream-v0-Instruct-7B):
config.json with every official field (`auto_map`, `architectures`, LLaDA's OLMo names or Dream's Qwen2
names), generation_config.json, tokenizer.json + tokenizer_config.json, and model.safetensors with the
official tensor names and shapes -- but tiny (a few layers, hidden 32-64, a vocabulary of 128), with the
special ids remapped through the config fields (`mask_token_id`, `eos_token_id`, `pad_token_id`). The
official modeling code is not shipped (it is not ours to ship); dlrl needs none.

The tokenizer (made with the `tokenizers` library) is character-level plus the family's special
tokens under their real strings: LLaDA `<|endoftext|>` (eos = pad), `<|startoftext|>`,
`<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`, `<|mdm_mask|>`; Dream `<|endoftext|>` (pad),
`<|im_start|>`, `<|im_end|>` (eos), `<|beginoftext|>`, `<|mask|>`; each with its family's chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dllm.full.config import FullAttentionConfig, official_dream_config, official_llada_config
from dllm.meta import materialize, on_meta

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHARS = "0123456789+-*/=()., :?\n" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "!#'<>[]_{|}~;"
UNK = "<|unk|>"
SPECIALS = {
    "llada": ["<|endoftext|>", "<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
              "<|mdm_mask|>"],
    "dream": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"],
}
TEMPLATES = {
    "llada": ("{{ '<|startoftext|>' }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
              "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "dream": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}
VOCAB_SIZE = 128
# the published special ids (GSAI-ML/LLaDA-8B-Instruct, Dream-org/Dream-v0-Instruct-7B), for real_ids folders
REAL_IDS = {
    "llada": {"<|endoftext|>": 126081, "<|startoftext|>": 126080, "<|start_header_id|>": 126346,
              "<|end_header_id|>": 126347, "<|eot_id|>": 126348, "<|mdm_mask|>": 126336},
    "dream": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|beginoftext|>": 151665,
              "<|mask|>": 151666},
}
# the published shapes: build_full_folder(out, family, **PUBLISHED[family], num_hidden_layers=2) for a
# real-shaped random model with fewer layers (with real_ids=True so the tokenizer has the real special ids)
PUBLISHED: dict[str, dict[str, Any]] = {
    "llada": dict(vocab_size=126464, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "dream": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072),
}


def tokenizer_vocab(family: str, real_ids: bool = False) -> dict[str, int]:
    """token -> id: the unknown token, the characters, then the family's special tokens (ids < VOCAB_SIZE);
    with `real_ids` the special tokens sit at their published ids and `<|fill_N|>` tokens fill the gaps."""
    vocab = {UNK: 0}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    if not real_ids:
        for t in SPECIALS[family]:
            vocab[t] = len(vocab)
        assert len(vocab) <= VOCAB_SIZE
        return vocab
    at = {i: t for t, i in REAL_IDS[family].items()}
    while len(vocab) <= max(at):
        i = len(vocab)
        vocab[at.get(i, f"<|fill_{i}|>")] = i
    return vocab


def build_family_tokenizer(out_dir: str | Path, family: str, real_ids: bool = False) -> PreTrainedTokenizerBase:
    """Write tokenizer.json + tokenizer_config.json of the family's tiny tokenizer and return it (`real_ids`:
    special tokens at their published ids)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from dllm.tokenizer import load_tokenizer

    vocab = tokenizer_vocab(family, real_ids)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [UNK, *SPECIALS[family]]])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    sp = SPECIALS[family]
    names = ({"bos_token": sp[1], "eos_token": sp[0], "pad_token": sp[0], "mask_token": sp[5]} if family == "llada"
             else {"bos_token": sp[3], "eos_token": sp[2], "pad_token": sp[0], "mask_token": sp[4]})
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **names, "unk_token": UNK,
        "additional_special_tokens": [t for t in sp if t not in names.values()],
        "chat_template": TEMPLATES[family], "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    return load_tokenizer(out)


def tiny_full_config(family: str, real_ids: bool = False, **fields: Any) -> FullAttentionConfig:
    """The tiny config of a family (special ids those of its tiny tokenizer); `fields` override."""
    v = tokenizer_vocab(family, real_ids)
    if family == "llada":
        ids = dict(mask_token_id=v["<|mdm_mask|>"], eos_token_id=v["<|endoftext|>"], pad_token_id=v["<|endoftext|>"],
                   bos_token_id=v["<|startoftext|>"], rope_theta=500000.0, rms_norm_eps=1e-5,
                   rope_full_precision=True, attention_bias=False, num_key_value_heads=4)
    else:
        ids = dict(mask_token_id=v["<|mask|>"], eos_token_id=v["<|endoftext|>"], pad_token_id=v["<|endoftext|>"],
                   bos_token_id=v["<|endoftext|>"], rope_theta=1000000.0, rms_norm_eps=1e-6,
                   rope_full_precision=False, attention_bias=True, num_key_value_heads=2)
    base: dict[str, Any] = dict(family=family, model_type="llada" if family == "llada" else "Dream",
                                vocab_size=len(v) if real_ids else VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, head_dim=8, max_position_embeddings=512, block_size=4,
                                tie_word_embeddings=False, torch_dtype="float32", **ids)
    base.update(fields)
    if "hidden_size" in fields or "num_attention_heads" in fields:
        base["head_dim"] = base["hidden_size"] // base["num_attention_heads"]
    return FullAttentionConfig(**base)


def build_full_folder(out_dir: str | Path, family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                      eos_scale: float = 0.0, real_ids: bool = False, init_std: float = 0.02, **fields: Any) -> Path:
    """A random-weight folder of the family in its official layout (see the module docstring). `init_std`: the
    std of the random linear / embedding weights (larger: more peaked next-token distributions). `eos_scale` > 0
    scales the output row of the chat end token (`<|eot_id|>` / `<|im_end|>`) up so that a random model
    ends its answers early, as a chat model does. `real_ids`: special tokens at their published ids (the
    vocabulary then spans them; pass `**PUBLISHED[family]` for the published shapes). The model is made
    once, in `dtype`. Returns the folder."""
    from dllm.full.model import FullAttentionLM
    from dllm.weights import save_weights

    out = Path(out_dir)
    if real_ids:
        ids = REAL_IDS[family]
        mask, pad = ("<|mdm_mask|>", "<|endoftext|>") if family == "llada" else ("<|mask|>", "<|endoftext|>")
        bos = "<|startoftext|>" if family == "llada" else "<|endoftext|>"
        fields = {"mask_token_id": ids[mask], "eos_token_id": ids[pad], "pad_token_id": ids[pad],
                  "bos_token_id": ids[bos], **fields}
    cfg = tiny_full_config(family, real_ids, **fields)
    cfg.raw = official_llada_config(cfg) if family == "llada" else official_dream_config(cfg)
    cfg.raw.pop("block_size", None)  # the official configs have no decoding block size
    tok = build_family_tokenizer(out, family, real_ids)
    torch.manual_seed(seed)
    with on_meta():
        model = FullAttentionLM(cfg)
    model = materialize(model, "cpu", dtype)
    model.init_weights(init_std)
    end = tok.convert_tokens_to_ids("<|eot_id|>" if family == "llada" else "<|im_end|>")
    if eos_scale > 0:
        weight = model.head.weight
        assert isinstance(weight, torch.Tensor)
        with torch.no_grad():
            row = weight[end]
            row.mul_(eos_scale / row.norm())
    save_weights(model.hf_named_tensors(), out, dtype=dtype, max_shard_bytes=2 << 30)
    cfg.torch_dtype = str(dtype).removeprefix("torch.")
    data = cfg.to_dict()
    data.pop("block_size", None)
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    eos = [cfg.eos_token_id, end] if family == "llada" else [end, cfg.eos_token_id]
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": cfg.pad_token_id,
        "mask_token_id": cfg.mask_token_id, "transformers_version": "4.46.3"}, indent=2) + "\n")
    return out


def build_llada_folder(out_dir: str | Path, **kw: Any) -> Path:
    return build_full_folder(out_dir, "llada", **kw)


def build_dream_folder(out_dir: str | Path, **kw: Any) -> Path:
    return build_full_folder(out_dir, "dream", **kw)
