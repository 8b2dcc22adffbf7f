"""PlainTokenizer (dllm/plain_tokenizer.py): a self-contained PreTrainedTokenizerFast folder loads without
transformers and answers every method dlrl uses exactly as transformers.AutoTokenizer's tokenizer does;
folders with options transformers applies to the backend still load through transformers."""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dllm.embedded.full_folders import build_family_tokenizer
from dllm.plain_tokenizer import PlainTokenizer
from dllm.tokenizer import CHARS, SPECIAL_TOKENS, build_char_tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _auto(folder: Path):
    from transformers import AutoTokenizer, PretrainedConfig

    return AutoTokenizer.from_pretrained(str(folder), config=PretrainedConfig(), local_files_only=True,
                                         trust_remote_code=False)


@pytest.fixture(scope="module", params=["char", "llada", "dream"])
def folder(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "char":
        build_char_tokenizer(out)
    else:
        build_family_tokenizer(out, request.param)
    return out


def test_a_plain_folder_answers_as_autotokenizer_does(folder):
    from transformers import PreTrainedTokenizerFast

    ours, auto = load_tokenizer(folder), _auto(folder)
    assert isinstance(ours, PlainTokenizer) and isinstance(auto, PreTrainedTokenizerFast)
    specials = list(json.loads((folder / "tokenizer.json").read_text())["added_tokens"])
    rng = random.Random(0)
    pieces = [*CHARS, *(t["content"] for t in specials), "é", "🙂", "  "]
    texts = ["", "What is 2+3?", "<|im_start|>x<|im_end|> <|MASK|>"] + [
        "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40))) for _ in range(200)]
    for text in texts:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == auto.encode(text, add_special_tokens=special)
    n = len(auto)
    id_lists = [[rng.randrange(n) for _ in range(rng.randrange(0, 30))] for _ in range(300)] + [[0], [n - 1]]
    for ids in id_lists:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert ours.decode(3) == auto.decode(3)
    assert ours.batch_decode(id_lists[:20]) == auto.batch_decode(id_lists[:20])
    assert ours.batch_decode([[i] for i in range(n)]) == auto.batch_decode([[i] for i in range(n)])
    tokens = [*(t["content"] for t in specials), "a", "7", "not-a-token"]
    assert ours.convert_tokens_to_ids(tokens) == auto.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("not-a-token") == auto.convert_tokens_to_ids("not-a-token")
    assert ours.convert_ids_to_tokens(list(range(n))) == auto.convert_ids_to_tokens(list(range(n)))
    assert ours.get_vocab() == auto.get_vocab() and (len(ours), ours.vocab_size) == (len(auto), auto.vocab_size)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token"):
        assert getattr(ours, name) == getattr(auto, name), name
        assert getattr(ours, name + "_id") == getattr(auto, name + "_id"), name
    assert (ours.all_special_tokens, ours.all_special_ids) == (auto.all_special_tokens, auto.all_special_ids)
    assert (ours.chat_template, ours.model_max_length) == (auto.chat_template, auto.model_max_length)
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]):
        for add in (False, True):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=add) == (
                auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=add))


def test_streamed_decoding_through_the_backend_is_the_same(folder):
    """dllm.detokenize streams through `backend_tokenizer` (tokenizers' DecodeStream)."""
    from dllm.detokenize import TextStream

    ours, auto = load_tokenizer(folder), _auto(folder)
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(len(auto)) for _ in range(rng.randrange(1, 25))]
        a, b = TextStream(ours), TextStream(auto)
        for i in range(0, len(ids), 3):
            assert a.push(ids[i:i + 3]) == b.push(ids[i:i + 3])
        assert a.text == b.text


def test_a_plain_folder_loads_without_importing_transformers(tiny_model_dir):
    code = ("import sys, copy; from dllm.tokenizer import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
            "c = copy.deepcopy(t); ids = c.encode('12+34=', add_special_tokens=False); "
            "assert c.decode(ids) == '12+34=' and t.eos_token_id is not None; "
            "print(type(t).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, tiny_model_dir], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["PlainTokenizer", "False"]


@pytest.mark.parametrize("change", [
    {"add_bos_token": True, "bos_token": "<|endoftext|>"},  # transformers rebuilds the post-processor
    {"clean_up_tokenization_spaces": True},
    {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|new|>"]},  # a special token to add
    {"auto_map": {"AutoTokenizer": [None, "x.Y"]}},
])
def test_options_transformers_applies_keep_the_transformers_path(tiny_model_dir, tmp_path, change):
    folder = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert not PlainTokenizer.fits(folder)
    if "auto_map" in change:
        return  # AutoTokenizer's remote-code refusal: tests/server/test_stop_tokens.py
    ours, auto = load_tokenizer(folder), _auto(folder)
    assert type(ours) is type(auto)
    assert {k: str(v) for k, v in vars(ours).items()} == {k: str(v) for k, v in vars(auto).items()}
    text = "What is 2+3? <|im_start|>x<|im_end|> <|MASK|><|new|>"
    assert ours.encode(text) == auto.encode(text)
    assert ours.all_special_ids == auto.all_special_ids


def test_the_char_tokenizer_specials_come_first():
    assert SPECIAL_TOKENS[0] == "<|endoftext|>"  # ids 0..4: what the embedded configs' special ids assume
