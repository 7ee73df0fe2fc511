"""Incremental detokenization never splits a character and never shows a stop string."""

from jaxcb.detokenizer import IncrementalDetokenizer
from jaxcb.tokenizer import ByteTokenizer


def feed(text_bytes: bytes, stop=()):
    detok = IncrementalDetokenizer(ByteTokenizer(), list(stop))
    seen = []
    for b in text_bytes:
        hit = detok.add_token(b)
        seen.append(detok.text)
        if hit:
            break
    detok.finish()
    return detok, seen


def test_multibyte_characters_appear_only_when_complete():
    detok, seen = feed("aé✓".encode())
    assert seen == ["a", "a", "aé", "aé", "aé", "aé✓"]
    assert "\ufffd" not in "".join(seen)


def test_stop_string_is_cut_and_generation_stops():
    detok, _ = feed(b"hello world, goodbye", stop=["wor"])
    assert detok.stopped and detok.text == "hello "


def test_stream_text_holds_back_a_possible_stop_prefix():
    detok = IncrementalDetokenizer(ByteTokenizer(), ["STOP"])
    for b in b"abcST":
        detok.add_token(b)
    assert detok.text == "abcST" and detok.stream_text == "abc"
    for b in b"AY":
        detok.add_token(b)
    assert detok.stream_text == "abcSTAY"


def test_unfinished_character_is_flushed_at_the_end():
    detok, _ = feed("✓".encode()[:2])
    assert detok.text == "\ufffd" or detok.text.endswith("\ufffd")
