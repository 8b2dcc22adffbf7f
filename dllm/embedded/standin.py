"""Stand-ins for real checkpoints, built locally (no download): a Qwen2/Qwen3-style
byte-level BPE tokenizer and random-weight SDAR folders of a real config's shapes.

    tok = build_qwen_tokenizer("runs/standin")        # tokenizer.json + tokenizer_config.json
    build_real_shape_folder("runs/sdar-1l", "tests/fixtures/sdar-1.7b-chat.config.json",
                            num_hidden_layers=1)      # config.json (every field kept) + bf16 shards

The tokenizer has the special tokens of Qwen3 with their real ids (`<|endoftext|>` 151643,
`<|im_start|>` 151644, `<|im_end|>` 151645, ..., `</think>` 151668) plus SDAR's `<|MASK|>`
151669, Qwen2's pre-tokenizer regex, NFC normalisation, byte-level decoding and a Qwen-style
Jinja chat template in tokenizer_config.json (`tokenizer_class: Qwen2Tokenizer`, eos
`<|im_end|>`, as chat checkpoints ship it). Its BPE merges are learnt from a small corpus;
the regular ids up to 151642 are filled with byte strings no merge produces, so every id a
real-shape model can emit decodes.

The random folder keeps every field of the source config.json (only `num_hidden_layers`
changes), writes weights shard by shard (never the whole model in memory), a
generation_config.json with Qwen3's chat eos ids, and the stand-in tokenizer. The lm_head
row of `<|im_end|>` is scaled up (`im_end_scale`) so a random model ends turns after a few
tokens, as a chat model does.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dllm.meta import on_meta

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllm.config import SDARConfig

QWEN_PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
FIRST_SPECIAL_ID = 151643
QWEN_SPECIALS = [  # (content, special): Qwen3's added tokens in id order from 151643, then SDAR's mask
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False), ("<|MASK|>", True),
]
QWEN_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}
{%- if '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""
CORPUS = [
    "Find the value of x such that 3x + 5 = 20. Put the final answer in \\boxed{}.",
    "The answer is \\boxed{5}. We subtract 5 from both sides and divide by 3.",
    "What is the sum of the first 100 positive integers? The sum is 5050.",
    "Let f(x) = x^2 - 4x + 4. Then f(2) = 0, so the minimum value is 0.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "You are a helpful assistant. Please reason step by step.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Hello, world! Diffusion language models denoise several tokens at a time.",
]


def _byte_fillers(alphabet: list[str], taken: set[str]) -> Iterator[str]:
    for n in itertools.count(3):
        for combo in itertools.product(alphabet, repeat=n):
            s = "".join(combo)
            if s not in taken:
                yield s


def build_qwen_tokenizer(out_dir: str | Path, vocab_size: int = 2000) -> PreTrainedTokenizerBase:
    """Write the Qwen-style stand-in tokenizer into `out_dir` and return it (AutoTokenizer)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    learner = Tokenizer(models.BPE())
    learner.normalizer, learner.pre_tokenizer = normalizers.NFC(), pre
    learner.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(learner.to_str())["model"]
    vocab: dict[str, int] = dict(spec["vocab"])
    merges: list[tuple[str, str]] = [(a, b) for a, b in (m.split(" ") if isinstance(m, str) else m
                                                          for m in spec["merges"])]
    fillers = _byte_fillers(sorted(pre_tokenizers.ByteLevel.alphabet()), set(vocab))
    while len(vocab) < FIRST_SPECIAL_ID:  # unreachable by merges; decodes to 3 raw bytes
        vocab[next(fillers)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer, tok.pre_tokenizer = normalizers.NFC(), pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(c, special=s, normalized=False) for c, s in QWEN_SPECIALS])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    decoder = {str(FIRST_SPECIAL_ID + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                           "single_word": False, "special": s}
               for i, (c, s) in enumerate(QWEN_SPECIALS)}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|MASK|>"],
        "bos_token": None, "chat_template": QWEN_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "mask_token": "<|MASK|>", "model_max_length": 32768,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }, indent=2) + "\n")
    from dllm.tokenizer import load_tokenizer

    return load_tokenizer(out)


def _param_shapes(cfg: SDARConfig) -> list[tuple[str, tuple[int, ...]]]:
    from dllm.model import SDARForCausalLM

    with on_meta():
        model = SDARForCausalLM(cfg)
    return [(n, tuple(p.shape)) for n, p in model.hf_named_tensors()]  # HF names, tied weights once


STREAM_LEN = 4_194_301  # prime


def _window(stream: torch.Tensor, shape: torch.Size, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A `shape` tensor of `dtype` filled from `stream`, starting at a random offset (one pass)."""
    out = torch.empty(shape.numel(), dtype=dtype)
    pos, n = int(torch.randint(0, len(stream), (1,), generator=gen)), shape.numel()
    done = 0
    while done < n:
        take = min(n - done, len(stream) - pos)
        out[done:done + take].copy_(stream[pos:pos + take])
        done, pos = done + take, 0
    return out.view(shape)


def write_random_weights(out_dir: str | Path, cfg: SDARConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                         max_shard_bytes: int = 1 << 30, im_end_id: int | None = None,
                         im_end_scale: float = 0.0) -> None:
    """Random N(0, 0.02) weights (norm weights 1) for `cfg`, written shard by shard. Each tensor
    is a window of one N(0, 1) stream of a prime length (fast on a CPU; no two rows equal)."""
    from safetensors.torch import save_file

    out, gen = Path(out_dir), torch.Generator().manual_seed(seed)
    stream = torch.randn(STREAM_LEN, generator=gen).mul_(0.02)
    shards: list[list[str]] = [[]]
    shapes = _param_shapes(cfg)
    size = 0
    for name, shape in shapes:  # plan the shards
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    shape_of, weight_map = dict(shapes), {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                t = torch.ones(shape_of[name], dtype=dtype)
            else:
                t = _window(stream, torch.Size(shape_of[name]), gen, dtype)
            if name == "lm_head.weight" and im_end_id is not None and im_end_scale:
                row = torch.randn(t.shape[1], generator=gen)
                t[im_end_id] = row / row.norm() * im_end_scale
            tensors[name] = t
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        del tensors
    if len(shards) > 1:
        total = sum(torch.Size(s).numel() * dtype.itemsize for _, s in shapes)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def build_real_shape_folder(out_dir: str | Path, source_config: str | Path, num_hidden_layers: int = 1,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0, im_end_scale: float = 12.0,
                            max_shard_bytes: int = 1 << 30, overrides: dict | None = None,
                            tokenizer_from: str | Path | None = None) -> Path:
    """A random-weight SDAR folder with the shapes of `source_config` (fewer layers; `overrides`
    replace more fields, e.g. a smaller hidden size for unit tests), the stand-in Qwen tokenizer
    (built, or copied from `tokenizer_from`) and a generation_config.json; returns the folder."""
    import shutil

    from dllm.config import SDARConfig
    from dllm.tokenizer import load_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = json.loads(Path(source_config).read_text())
    data.update(overrides or {}, num_hidden_layers=num_hidden_layers)
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    cfg = SDARConfig.from_dict(data)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(Path(tokenizer_from) / name, out / name)
        tok = load_tokenizer(out)
    else:
        tok = build_qwen_tokenizer(out)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": data.get("bos_token_id"), "eos_token_id": [im_end, tok.convert_tokens_to_ids("<|endoftext|>")],
        "pad_token_id": tok.pad_token_id, "do_sample": False}, indent=2) + "\n")
    write_random_weights(out, cfg, dtype=dtype, seed=seed, max_shard_bytes=max_shard_bytes,
                         im_end_id=im_end, im_end_scale=im_end_scale)
    return out
