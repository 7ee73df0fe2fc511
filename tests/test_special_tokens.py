"""Special tokens in the text (skip_special_tokens=false, as vLLM): kept where a request asks, and
for every chat request whose tool parser reads a special-token marker (Mistral's [TOOL_CALLS]);
the EOS or stop token that ends a sequence counts in its ids and never shows in its text."""

import pytest

from engine_factory import shared_engine
from hf_checkpoints import write_word_tokenizer
from jaxcb.detokenizer import IncrementalDetokenizer
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.protocol import ChatCompletionRequest
from jaxcb.server.requests import plan_chat_completion
from jaxcb.server.tool_parsers import get_tool_parser
from jaxcb.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("words")
    write_word_tokenizer(str(path), 40)  # <unk>=0, <s>=1, </s>=2 are special
    return load_tokenizer(str(path))


@pytest.mark.parametrize("skip, text", [(True, "w5 w6"), (False, "w5 <s> w6")])
def test_special_tokens_show_only_when_the_request_keeps_them(word_tokenizer, skip, text):
    detok = IncrementalDetokenizer(word_tokenizer, stop=[], skip_special_tokens=skip)
    for token in (5, 1, 6):
        detok.add_token(token)
    detok.add_stop_token(2)  # </s>, the EOS that ends it
    detok.finish()
    assert detok.text == text and detok.token_ids == [5, 1, 6, 2]


def test_the_stop_token_that_ends_a_sequence_is_in_its_ids_never_in_its_text():
    e = shared_engine()
    probe = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    e.add_request(list(b"Once upon"), probe, request_id="probe")
    tokens = [o for _ in range(50) for o in e.step() if o.finished][0].outputs[0].token_ids
    stop = tokens[3]
    for skip in (True, False):
        e.add_request(list(b"Once upon"), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                          stop_token_ids=[stop], skip_special_tokens=skip),
                      request_id=f"stopped-{skip}")
        out = [o for _ in range(50) for o in e.step() if o.finished][0].outputs[0]
        end = tokens.index(stop) + 1
        assert out.token_ids == tokens[:end] and out.finish_reason == "stop"
        assert out.text == ByteTokenizer().decode(tokens[:end - 1])
    assert not e.has_unfinished_requests()


def test_a_chat_request_read_by_the_mistral_parser_keeps_special_tokens():
    """Mistral's [TOOL_CALLS] is a special token: dropped from the text, the parser would see no call."""
    tokenizer = ByteTokenizer()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    mistral = plan_chat_completion(ChatCompletionRequest(**body), tokenizer, get_tool_parser("mistral", None), 4096)
    hermes = plan_chat_completion(ChatCompletionRequest(**body), tokenizer, get_tool_parser("hermes", None), 4096)
    assert (mistral.params.skip_special_tokens, hermes.params.skip_special_tokens) == (False, True)
    no_tools = plan_chat_completion(ChatCompletionRequest(**{**body, "tools": None}), tokenizer,
                                    get_tool_parser("mistral", None), 4096)
    assert no_tools.params.skip_special_tokens  # no tools, no parser: as asked (the default)


GEMMA2_TEMPLATE = (  # Gemma 2's chat template: no system role, turns must alternate, no tools
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")


def test_tools_reach_a_gemma_template_that_refuses_system_turns_and_wants_turns_to_alternate():
    """Gemma's templates render no tools: the fallback writes them into the first user turn, and two
    tool results into one user turn."""
    tokenizer = ByteTokenizer()
    tokenizer.chat_template = GEMMA2_TEMPLATE
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [{"role": "user", "content": "What time is it in two zones?"},
                {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "c2"}]},
                {"role": "tool", "tool_call_id": "c1", "content": "10:00"},
                {"role": "tool", "tool_call_id": "c2", "content": "11:00"}]
    body = {"model": "tiny", "messages": messages, "tools": [tool]}
    plan = plan_chat_completion(ChatCompletionRequest(**body), tokenizer, get_tool_parser("hermes", None), 8192)
    prompt = tokenizer.decode(plan.prompts[0])
    first_user = prompt.split("<start_of_turn>user\n")[1]
    assert first_user.startswith("You can call the functions") and "get_time" in first_user
    assert "What time is it in two zones?" in first_user
    assert "10:00" in prompt and "11:00" in prompt and prompt.count("<start_of_turn>user") == 2
