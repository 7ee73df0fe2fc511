"""Byte-level fallback and HF tokenizer.json, with chat templates rendered by jinja2."""

import pytest

from hf_checkpoints import write_word_tokenizer
from jaxcb.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_byte_tokenizer_round_trips_unicode_and_adds_bos():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_token_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == "héllo ✓"
    assert tok.decode([257, 104, 105]) == "hi"  # specials are skipped


def test_byte_tokenizer_has_a_plain_chat_template():
    text = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>\nhi\n<|assistant|>\n"


def test_hf_tokenizer_uses_tokenizer_json_and_its_post_processor(tmp_path):
    write_word_tokenizer(str(tmp_path), 50, chat_template=LLAMA3_STYLE_TEMPLATE)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("w5 w7 w49") == [1, 5, 7, 49]
    assert tok.encode("w5", add_special_tokens=False) == [5]
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.decode([1, 5, 7]) == "w5 w7"


def test_hf_chat_template_renders_with_special_tokens(tmp_path):
    write_word_tokenizer(str(tmp_path), 50, chat_template=LLAMA3_STYLE_TEMPLATE)
    tok = load_tokenizer(str(tmp_path))
    text = tok.apply_chat_template([{"role": "user", "content": " w5 "}])
    assert text == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nw5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chat_template_can_raise_a_clear_error(tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    write_word_tokenizer(str(tmp_path), 20, chat_template=template)
    with pytest.raises(Exception, match="first message must be from the user"):
        load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "assistant", "content": "x"}])


def test_directory_without_tokenizer_json_falls_back_to_bytes(tmp_path):
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
