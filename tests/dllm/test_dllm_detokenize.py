"""Incremental detokenisation: text equals a full decode, never shows half a character, stops cut exactly."""

import random

import pytest

from dllm.detokenize import TextStream
from dllm.tokenizer import build_char_tokenizer

TEXT = "héllo wörld, naïve café 😀 → ok\n½ 中文 done"


@pytest.fixture(scope="module")
def byte_tok():
    """A byte-level BPE tokenizer: multi-byte characters are split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["hello world cafe ok done"] * 4, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")


@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("chartok"))


def test_text_is_a_clean_prefix_after_every_block(byte_tok):
    ids = byte_tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.encode()) // 2  # multi-byte characters really span tokens
    for block in (1, 3, 4, 7):
        stream = TextStream(byte_tok)
        for i in range(0, len(ids), block):
            assert stream.push(ids[i:i + block]) is None
            assert "\ufffd" not in stream.text and TEXT.startswith(stream.text)
        assert stream.text == TEXT == byte_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped(char_tok):
    ids = char_tok.encode("12+34=", add_special_tokens=False) + [char_tok.eos_token_id]
    stream = TextStream(char_tok)
    stream.push(ids)
    assert stream.text == char_tok.decode(ids, skip_special_tokens=True) == "12+34="


def fewest_tokens(tok, ids, stop):
    """The definition: fewest ids after which the full decode holds a stop string."""
    return next((n for n in range(1, len(ids) + 1)
                 if any(s in tok.decode(ids[:n], skip_special_tokens=True) for s in stop)), None)


@pytest.mark.parametrize("which", ["byte", "char"])
def test_stop_strings_cut_at_the_fewest_tokens(which, byte_tok, char_tok):
    tok = byte_tok if which == "byte" else char_tok
    rng = random.Random(0)
    text = TEXT if which == "byte" else "12+34=46\n7+8=15 done"
    ids = tok.encode(text, add_special_tokens=False)
    for _ in range(20):
        i = rng.randrange(1, len(text) - 2)
        stop = [text[i:i + rng.randint(1, 3)], "never there"]
        block = rng.choice([1, 2, 4, 8])
        stream, consumed, n = TextStream(tok, stop), 0, None
        for j in range(0, len(ids), block):
            n = stream.push(ids[j:j + block])
            if n is not None:
                consumed += n
                break
            consumed += len(ids[j:j + block])
        want = fewest_tokens(tok, ids, stop)
        assert n is not None and consumed == want, (stop, block)
        full = tok.decode(ids[:want], skip_special_tokens=True)
        assert stream.text == full[:min(full.find(s) for s in stop if s in full)]


def test_slow_tokenizer_fallback_gives_the_same_text(char_tok):
    class Slow:  # no fast backend: decode() only
        decode = staticmethod(char_tok.decode)

    ids = char_tok.encode("1+2=3\n4+5=9", add_special_tokens=False)
    fast, slow = TextStream(char_tok, ["=9"]), TextStream(Slow(), ["=9"])
    got = [(fast.push(ids[i:i + 4]), slow.push(ids[i:i + 4])) for i in range(0, len(ids), 4)]
    assert [a for a, _ in got] == [b for _, b in got] and fast.text == slow.text == "1+2=3\n4+5"
