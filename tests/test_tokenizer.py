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


def test_chat_template_jinja_file_is_read_when_tokenizer_config_has_none(tmp_path):
    write_word_tokenizer(str(tmp_path), 50)  # tokenizer_config.json without "chat_template"
    (tmp_path / "chat_template.jinja").write_text(LLAMA3_STYLE_TEMPLATE)
    text = load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "w5"}])
    assert text.startswith("<s><|start_header_id|>user<|end_header_id|>\n\nw5<|eot_id|>")


def test_chat_template_jinja_file_wins_over_tokenizer_config_as_in_transformers(tmp_path):
    write_word_tokenizer(str(tmp_path), 50, chat_template="{{ 'from tokenizer_config.json' }}")
    (tmp_path / "chat_template.jinja").write_text("{{ 'from chat_template.jinja' }}")
    assert load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}]) == "from chat_template.jinja"


def test_template_saved_by_transformers_renders_as_transformers_renders_it(tmp_path):
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "src").mkdir()
    write_word_tokenizer(str(tmp_path / "src"), 50)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "src" / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    theirs.chat_template = LLAMA3_STYLE_TEMPLATE
    theirs.save_pretrained(str(tmp_path / "saved"))
    chat = [{"role": "user", "content": " w5 "}, {"role": "assistant", "content": "w7"}]
    expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert load_tokenizer(str(tmp_path / "saved")).apply_chat_template(chat) == expected


def test_checkpoint_without_a_chat_template_says_so_and_uses_the_plain_one(tmp_path, caplog):
    write_word_tokenizer(str(tmp_path), 50)
    with caplog.at_level("WARNING", logger="jaxcb.tokenizer"):
        tok = load_tokenizer(str(tmp_path))
    assert "has no chat template" in caplog.text
    assert tok.apply_chat_template([{"role": "user", "content": "w5"}]) == "<|user|>\nw5\n<|assistant|>\n"


def test_save_writes_a_directory_that_loads_the_same_tokenizer_and_template(tmp_path):
    (tmp_path / "a").mkdir()
    write_word_tokenizer(str(tmp_path / "a"), 50)
    (tmp_path / "a" / "chat_template.jinja").write_text(LLAMA3_STYLE_TEMPLATE)
    (tmp_path / "b").mkdir()
    load_tokenizer(str(tmp_path / "a")).save(str(tmp_path / "b"))
    copy = load_tokenizer(str(tmp_path / "b"))
    assert copy.chat_template == LLAMA3_STYLE_TEMPLATE and copy.encode("w5 w7") == [1, 5, 7]
