"""Byte-level fallback and HF tokenizer.json, with chat templates rendered by jinja2."""

import pytest

from hf_checkpoints import write_word_tokenizer
from jaxcb.config import ConfigError
from jaxcb.tokenizer import (
    ByteTokenizer, ChatTemplateError, HFTokenizer, NoChatTemplateError, chat_prompt_ids, load_tokenizer,
    read_chat_template_override,
)

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


def test_checkpoint_directory_without_tokenizer_json_is_refused_naming_model_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match=r"has no tokenizer.json.*set model.tokenizer=DIR"):
        load_tokenizer(str(tmp_path))
    assert isinstance(load_tokenizer(None), ByteTokenizer)  # random weights, no checkpoint: bytes


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


def test_checkpoint_without_a_chat_template_refuses_chat_and_says_what_to_do(tmp_path, caplog):
    write_word_tokenizer(str(tmp_path), 50)
    with caplog.at_level("WARNING", logger="jaxcb.tokenizer"):
        tok = load_tokenizer(str(tmp_path))
    assert "has no chat template: chat requests will be refused" in caplog.text
    with pytest.raises(NoChatTemplateError, match=r"no chat template.*/v1/completions.*server.chat_template="):
        chat_prompt_ids(tok, [{"role": "user", "content": "w5"}])
    assert tok.encode("w5") == [1, 5]  # completions are unaffected


def test_chat_template_override_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}!")
    assert read_chat_template_override(str(path)) == "{{ messages[0]['content'] }}!"
    assert read_chat_template_override("{{ messages | length }}") == "{{ messages | length }}"
    with pytest.raises(ConfigError, match=r"server.chat_template=nothere.jinja is neither a file nor a Jinja template"):
        read_chat_template_override("nothere.jinja")


def test_tiny_template_renders_tools_tool_calls_and_tool_results():
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    text = ByteTokenizer().apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    assert text == (
        "<|system|>\nTools; call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n"
        '{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}\n'
        "<|user|>\nWeather in Oslo?\n"
        '<|assistant|>\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        "<|tool|>\nrain\n"
        "<|assistant|>\n"
    )


def test_a_template_that_cannot_read_a_message_is_a_request_error():
    with pytest.raises(ChatTemplateError, match="chat template"):
        chat_prompt_ids(ByteTokenizer(), [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}])


def test_save_writes_a_directory_that_loads_the_same_tokenizer_and_template(tmp_path):
    (tmp_path / "a").mkdir()
    write_word_tokenizer(str(tmp_path / "a"), 50)
    (tmp_path / "a" / "chat_template.jinja").write_text(LLAMA3_STYLE_TEMPLATE)
    (tmp_path / "b").mkdir()
    load_tokenizer(str(tmp_path / "a")).save(str(tmp_path / "b"))
    copy = load_tokenizer(str(tmp_path / "b"))
    assert copy.chat_template == LLAMA3_STYLE_TEMPLATE and copy.encode("w5 w7") == [1, 5, 7]
