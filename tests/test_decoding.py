"""The generated text grown a token at a time (``decoding.TextStream``): the same text as decoding every
token at once, each step's text a prefix of the final one, at a cost linear in the tokens."""

from __future__ import annotations

import random

import pytest

from tierkv.decoding import TextStream, maybe_partial, stop_in_tail
from tierkv.default_model import BYTE_OFFSET, ByteTokenizer

from helpers import save_byte_tokenizer


def _hf_byte_level(tmp_path):
    from transformers import AutoTokenizer

    save_byte_tokenizer(tmp_path / "bytes")
    return AutoTokenizer.from_pretrained(tmp_path / "bytes")


def _hf_metaspace():
    """A SentencePiece-like tokenizer: words with a leading '▁', whose decoder drops the first one's space
    (decoding from the middle of a text drops it too: the context window must absorb that)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["▁the", "▁cat", "▁sat", "s", "▁on", "▁é", "t", "▁", "."]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="."))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


_WORDS = ["I", "do", "n't", "know", "it", "'", "s", ".", ",", "?", "##s", "##ing", "not", "'s", "'ve", "n"]


def _hf_cleanup(in_decoder: bool):
    """Tokenizers whose clean-up joins text across tokens ("do n't" is "don't", "it 's" "it's"): in the
    decoder itself (WordPiece's), or Hugging Face's ``clean_up_tokenization_spaces`` after it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(_WORDS)}, unk_token="."))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=in_decoder)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=not in_decoder)


def _ids(kind: str, rng: random.Random, n: int, tokenizer) -> list[int]:
    """Up to ``n`` tokens of text with multi-byte characters and stray bytes (as a random model emits)."""
    if kind == "metaspace":
        return [rng.randrange(9) for _ in range(n)]
    if kind.endswith("cleanup"):
        return [rng.randrange(len(_WORDS)) for _ in range(n)]
    text = "".join(rng.choice(["a", " b", "é", "€", "😀", "\n", "xyz"]) for _ in range(n))
    raw = list(text.encode())
    for _ in range(n // 10):
        raw.insert(rng.randrange(len(raw)), rng.choice([0x80, 0xFF, 0xC3, 0xE2]))
    if kind == "bytes":
        return [b + BYTE_OFFSET for b in raw[:n]]
    return tokenizer.convert_tokens_to_ids([_BYTE_SYMBOL[b] for b in raw[:n]])  # a token per byte here


def _byte_symbols() -> dict[int, str]:
    """The byte-level alphabet's symbol of each byte: printable ones stand for themselves, the others for
    the characters from U+0100 on, in byte order (what ``pre_tokenizers.ByteLevel`` uses)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


_BYTE_SYMBOL = _byte_symbols()


@pytest.mark.parametrize("kind", ["bytes", "hf_byte_level", "metaspace", "decoder_cleanup", "hf_cleanup"])
def test_text_grown_a_token_at_a_time_is_the_text_of_all_tokens(kind, tmp_path) -> None:
    makers = {
        "bytes": ByteTokenizer,
        "hf_byte_level": lambda: _hf_byte_level(tmp_path),
        "metaspace": _hf_metaspace,
        "decoder_cleanup": lambda: _hf_cleanup(in_decoder=True),
        "hf_cleanup": lambda: _hf_cleanup(in_decoder=False),
    }
    tokenizer = makers[kind]()
    rng = random.Random(7)
    cleanup = kind.endswith("cleanup")
    for trial in range(200 if cleanup else 20):
        ids = _ids(kind, rng, rng.randrange(1, 30 if cleanup else 120), tokenizer)
        whole = tokenizer.decode(ids)
        stream = TextStream.of(tokenizer)
        for i, tok in enumerate(ids):
            stream.add(tok)
            assert not stream.text or not maybe_partial(stream.text[-1])
            if not stream.whole:  # in pieces: what may be sent is final (a clean-up may rewrite, as before)
                assert whole.startswith(stream.text), (kind, trial, i)
        assert stream.finish() == whole, (kind, trial)
    # Hugging Face's clean-up is decoded whole from the start; a decoder's own once the pieces disagree
    assert TextStream.of(tokenizer).whole is (kind == "hf_cleanup")


def test_a_stop_string_before_an_incomplete_character_is_found_at_once() -> None:
    """A token of a space and the first byte of a character ends "Answer: ": the stop string is there as
    the tokenizer decodes it now (before, the whole text, incomplete character and all, was searched)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merged = _BYTE_SYMBOL[0x20] + _BYTE_SYMBOL[0xE2]  # " " and the first byte of "€", one token
    vocab[merged] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(_BYTE_SYMBOL[0x20], _BYTE_SYMBOL[0xE2])]))
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    stream = TextStream.of(tokenizer)
    for i in [vocab[_BYTE_SYMBOL[b]] for b in b"Answer:"] + [vocab[merged]]:
        stream.add(i)
    assert stream.text == "Answer:" and stream.pending.startswith(" ")
    assert stream.stopped(["Answer: "]) and not stream.stopped(["Answer:!"])


def test_a_long_generation_decodes_each_token_a_bounded_number_of_times() -> None:
    """4,000 tokens: the tokens handed to the tokenizer grow linearly (decoding all of them at every step,
    as before, handed it 8 million)."""
    tokenizer, handed = ByteTokenizer(), [0]

    def decode(ids: list[int]) -> str:
        handed[0] += len(ids)
        return tokenizer.decode(ids)

    stream = TextStream(decode)
    ids = [b + BYTE_OFFSET for b in ("word é€ " * 500).encode()][:4000]
    for tok in ids:
        stream.add(tok)
    assert stream.finish() == tokenizer.decode(ids)
    assert handed[0] <= 8 * len(ids), handed[0]


def test_a_stop_string_is_found_across_the_steps_that_made_it() -> None:
    stop = ["STOP", "xy"]
    text, checked, found = "", 0, []
    for piece in ["abc S", "T", "O", "P and more"]:
        text += piece
        found.append(stop_in_tail(text, stop, checked))
        checked = len(text)
    assert found == [False, False, False, True]
    assert not stop_in_tail("x" * 1000 + "STOP", ["STOP"], 1004)  # (all of it searched before)
    assert stop_in_tail("x" * 1000 + "STOP", ["STOP"], 1001)


def test_a_decoding_that_rewrites_the_text_before_it_is_decoded_whole_from_then_on() -> None:
    """A token that changes how the one before it reads (here "!" upper-cases the word it follows, as a
    clean-up may join "do n't"): the pieces' difference cannot say that, so the stream decodes every token
    from there on, and its text is still the tokenizer's text of all of them."""
    words = ["a", "quiet", "word", "!"]

    def decode(ids: list[int]) -> str:
        out: list[str] = []
        for i in ids:
            if words[i] == "!" and out:
                out[-1] = out[-1].upper() + "!"
            else:
                out.append(words[i])
        return " ".join(out)

    ids = [0, 1, 2, 3, 0, 1]
    stream = TextStream(decode)
    for i in ids[:3]:
        stream.add(i)
    assert not stream.whole and stream.text == "a quiet word"
    for i in ids[3:]:
        stream.add(i)
    assert stream.whole and stream.finish() == decode(ids) == "a quiet WORD! a quiet"
