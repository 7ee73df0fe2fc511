"""Tool call parsing, streaming and grammars (jaxcb/server/tool_parsers.py, tool_grammar.py). No model, no jax:
grammars are walked with llguidance over a byte-level vocabulary, choosing allowed tokens at random."""

import json
import random
import re

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from jaxcb.server.tool_grammar import tool_call_grammar
from jaxcb.server.tool_parsers import TOOL_CALL_PARSERS, ParsedToolOutput, ToolCallDelta, get_tool_parser
from jaxcb.tokenizer import TINY_CHAT_TEMPLATE

SYNTAXES = ("hermes", "llama3_json", "pythonic", "mistral")


def _calls(parsed: ParsedToolOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def _hermes(name: str, arguments: str, sep: str = "\n") -> str:
    return f'<tool_call>{sep}{{"name": "{name}", "arguments": {arguments}}}{sep}</tool_call>'


def _llama3(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def _mistral(*calls: tuple[str, str]) -> str:
    return "[TOOL_CALLS][" + ", ".join(f'{{"name": "{name}", "arguments": {arguments}}}' for name, arguments in calls) + "]"


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _stream(syntax: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[ToolCallDelta]]:
    """(content, [(name, arguments)] by index, every delta) of a stream fed `pieces`."""
    streamer = get_tool_parser(syntax, None).streamer()
    content, deltas = "", []
    for piece in [*pieces, None]:
        text, new = streamer.feed(piece) if piece is not None else streamer.finish()
        content += text
        deltas += new
    calls: dict[int, list] = {}
    for delta in deltas:
        if delta.id is not None:
            assert delta.index not in calls and delta.name, "a call's first delta carries id and name"
            calls[delta.index] = [delta.name, ""]
        calls[delta.index][1] += delta.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


# Per syntax: outputs the stream must agree with `parse` on, whatever the split.
STREAM_CASES = {
    "hermes": [
        _hermes("get_weather", '{"city": "Paris", "days": 3}'),
        "Let me look.\n" + _hermes("a", '{"x": [1, {"y": "}"}]}') + "\n" + _hermes("b", "{}", sep="") + " Done.",
        _hermes("quote", r'{"s": "say \"hi\" \\ <tool_call>", "é": "naïve"}'),
        '<tool_call>\n{"arguments": {"k": 1}, "name": "late_name"}\n</tool_call>',
        '<tool_call>{"name": "s", "arguments": "{\\"k\\": 2}"}</tool_call>',
        '<tool_call>{"name": "unclosed", "arguments": {"k": 1}}',
        "A plain answer with <b>tags</b>, a <tool_ and a lone <",
        "<tool_call>not json</tool_call> then text",
        "   \n  ",
    ],
    "llama3_json": [
        _llama3("get_weather", '{"city": "Paris"}'),
        ' ' + _llama3("a", '{"x": [1, 2]}') + ' ; {"name": "b", "arguments": {}}',
        "Checking.<|python_tag|>" + _llama3("a", '{"s": "{;}"}'),
        _llama3("a", "{}") + "; and some text",
        '{"answer": 42} is plain JSON',
        "The set {1, 2} is not a call",
        "text with a <|python_ta",
        "  ",
    ],
    "pythonic": [
        '[get_weather(city="Paris", days=3)]',
        'I will check.\n[a(x=[1, 2], y={"k": None}), b()] and [c(flag=true, none=null)]',
        "See [1] and [note] and [f(1)] and [g(x=1) + 2]",
        "[f(s='it\\'s ]')]",
        "[f(x=1), not_a_call]",
        "unclosed [f(x=",
        "a trailing [",
    ],
    "mistral": [
        _mistral(("get_weather", '{"city": "Paris", "days": 3}')),
        "I will check. " + _mistral(("a", '{"x": [1, {"y": "]"}]}'), ("b", "{}")) + " Done.",
        _mistral(("quote", r'{"s": "say \"hi\" [TOOL_CALLS]", "é": "naïve"}')),
        '[TOOL_CALLS][{"arguments": {"k": 1}, "name": "late_name"}]',
        '[TOOL_CALLS] [{"name": "unclosed", "arguments": {"k": 1}}',
        "A plain answer with [brackets], a [TOOL_ and a lone [",
        "[TOOL_CALLS] not a list",
        "   \n  ",
    ],
}
# Calls whose text turns out malformed after their head: a stream may have announced them already.
LATE_MALFORMED = {
    "hermes": _hermes("f", '{"x": 1') + " cut",
    "llama3_json": _llama3("f", '{"x": 1') + ' oops}; ' + _llama3("g", "{}"),
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1} oops}]',
}


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_single_call_is_parsed_with_compact_arguments(syntax):
    text = {"hermes": _hermes("get_weather", '{"city" : "Paris",\n "days": 3}'),
            "llama3_json": _llama3("get_weather", '{"city" : "Paris",\n "days": 3}'),
            "pythonic": '[get_weather(city="Paris", days=3)]',
            "mistral": _mistral(("get_weather", '{"city" : "Paris",\n "days": 3}'))}[syntax]
    parsed = get_tool_parser(syntax, None).parse(text)
    assert parsed.content is None
    [call] = parsed.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris","days":3}')
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_several_calls_are_parsed_in_order(syntax):
    text = {"hermes": _hermes("a", '{"x": 1}') + "\n" + _hermes("b", "{}"),
            "llama3_json": _llama3("a", '{"x": 1}') + "; " + _llama3("b", "{}"),
            "pythonic": "[a(x=1), b()]",
            "mistral": _mistral(("a", '{"x": 1}'), ("b", "{}"))}[syntax]
    parsed = get_tool_parser(syntax, None).parse(text)
    assert (parsed.content, _calls(parsed)) == (None, [("a", {"x": 1}), ("b", {})])
    assert len({call.id for call in parsed.tool_calls}) == 2


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_text_before_a_call_is_content(syntax):
    text = {"hermes": "Let me check.\n" + _hermes("a", '{"x": 1}'),
            "llama3_json": "Let me check.\n<|python_tag|>" + _llama3("a", '{"x": 1}'),
            "pythonic": 'Let me check.\n[a(x=1)]',
            "mistral": "Let me check.\n" + _mistral(("a", '{"x": 1}'))}[syntax]
    parsed = get_tool_parser(syntax, None).parse(text)
    assert (parsed.content, _calls(parsed)) == ("Let me check.", [("a", {"x": 1})])


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_output_without_a_call_is_all_content(syntax):
    text = '  Paris is sunny: {"temp": 21} [see note] <b>ok</b>  '
    parsed = get_tool_parser(syntax, None).parse(text)
    assert (parsed.content, parsed.tool_calls) == (text.strip(), [])
    assert get_tool_parser(syntax, None).parse(" \n").content is None


@pytest.mark.parametrize("syntax, text", [
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1,}}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "a"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call> and text'),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}'),
    ("llama3_json", '{"name": 7, "parameters": {}}'),
    ("pythonic", "[a(1, x=2)]"),
    ("pythonic", "[a(x=open('f'))]"),
    ("pythonic", "[a(x=1)"),
    ("pythonic", "[a(**kw)]"),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1,}}]'),
    ("mistral", '[TOOL_CALLS]{"name": "a", "arguments": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": 7, "arguments": {}}] and text'),
])
def test_malformed_call_stays_content(syntax, text):
    parsed = get_tool_parser(syntax, None).parse(text)
    assert (parsed.content, parsed.tool_calls) == (text.strip(), [])


def test_malformed_block_is_content_and_later_calls_still_count():
    text = "<tool_call>oops</tool_call>\n" + _hermes("b", '{"y": "z"}')
    parsed = get_tool_parser("hermes", None).parse(text)
    assert (parsed.content, _calls(parsed)) == ("<tool_call>oops</tool_call>", [("b", {"y": "z"})])


def test_llama3_accepts_arguments_key_and_text_after_the_calls():
    parsed = get_tool_parser("llama3_json", None).parse('{"name": "a", "arguments": {"x": 1}} Hope that helps.')
    assert (parsed.content, _calls(parsed)) == ("Hope that helps.", [("a", {"x": 1})])


def test_pythonic_values_become_json():
    parsed = get_tool_parser("pythonic", None).parse(
        "[f(a=True, b=None, c=false, d=null, e=-1.5, s='x\\\"y', t=(1, 2), u={'k': [true]}, v='\\ud83d\\ude00')]")
    assert parsed.tool_calls[0].arguments == (
        '{"a":true,"b":null,"c":false,"d":null,"e":-1.5,"s":"x\\"y","t":[1,2],"u":{"k":[true]},"v":"😀"}')


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_stream_equals_parse_for_random_splits(syntax):
    parser = get_tool_parser(syntax, None)
    for text in STREAM_CASES[syntax]:
        parsed = parser.parse(text)
        expected = (parsed.content or "", [(call.name, call.arguments) for call in parsed.tool_calls])
        rng = random.Random(text)
        for pieces in [[text], list(text)] + [_random_pieces(text, rng) for _ in range(40)]:
            assert _stream(syntax, pieces)[:2] == expected, (text, pieces)


# Fragments that random outputs are glued from: calls, near-calls, markers cut short, plain text.
FUZZ_FRAGMENTS = {
    "hermes": [_hermes("f", '{"x": [1, "}"]}'), "<tool_call>", "</tool_call>", '{"name": "f", "arguments": ',
               '{"x": [1, "}"]}', "}", "\n", " ", "text", "<tool", '"', "{"],
    "llama3_json": [_llama3("f", '{"x": "a;b"}'), '{"name": "f", "parameters": ', '{"x": [1, "}"]}', "}", ";", " ",
                    "text", "<|python_tag|>", "<|py", '"', "{"],
    "pythonic": ["[f(x=1, y='a]')]", "[", "f(", "x=1", ", ", "y='a]'", ")", "]", "text", " ", "(", '"'],
    "mistral": [_mistral(("f", '{"x": [1, "]"]}')), "[TOOL_CALLS]", "[", "]", ", ", '{"name": "f", "arguments": ',
                '{"x": [1, "}"]}', "}", " ", "text", "[TOOL", '"', "{"],
}


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_stream_content_equals_parse_and_keeps_its_calls_for_random_outputs(syntax):
    parser, rng = get_tool_parser(syntax, None), random.Random(syntax)
    for _ in range(300):
        text = "".join(rng.choice(FUZZ_FRAGMENTS[syntax]) for _ in range(rng.randint(1, 14)))
        parsed = parser.parse(text)
        content, calls, _ = _stream(syntax, _random_pieces(text, rng) if len(text) > 1 else [text])
        assert content == (parsed.content or ""), text
        streamed = iter(calls)  # parse's calls, in order, among the stream's (plus any abandoned ones)
        assert all((call.name, call.arguments) in streamed for call in parsed.tool_calls), text


@pytest.mark.parametrize("syntax", sorted(LATE_MALFORMED))
def test_stream_keeps_a_call_announced_before_it_turned_out_malformed(syntax):
    text = LATE_MALFORMED[syntax]
    parsed = get_tool_parser(syntax, None).parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])
    rng = random.Random(0)
    for pieces in [list(text)] + [_random_pieces(text, rng) for _ in range(20)]:
        content, calls, _ = _stream(syntax, pieces)
        assert content == text  # the malformed text still arrives, as content
        # announced if some delta ended between its head and its end; never withdrawn
        assert [name for name, _ in calls] in ([], ["f"])
    assert _stream(syntax, list(text))[1] == [("f", '{"x":1}')]


def test_stream_sends_name_early_and_arguments_in_fragments():
    streamer = get_tool_parser("hermes", None).streamer()
    assert streamer.feed("Sure <tool_") == ("Sure", [])  # a possible marker is held back
    assert streamer.feed('call>\n{"name": "get_weather", ') == ("", [])
    _, [first] = streamer.feed('"arguments": {"city"')
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city"')
    assert first.id.startswith("call_")
    assert streamer.feed(': "Par') == ("", [ToolCallDelta(0, arguments=':"Par')])
    assert streamer.feed('is"}}\n</tool_call>') == ("", [ToolCallDelta(0, arguments='is"}')])
    assert streamer.finish() == ("", [])


def test_pythonic_stream_holds_a_possible_call_list_and_sends_each_call_whole():
    streamer = get_tool_parser("pythonic", None).streamer()
    assert streamer.feed("See [1], then [get_") == ("See [1], then", [])
    assert streamer.feed('weather(city="Paris"') == ("", [])
    _, [delta] = streamer.feed(")]")
    assert (delta.index, delta.name, delta.arguments) == (0, "get_weather", '{"city":"Paris"}')


@pytest.mark.parametrize("template, expected", [
    (TINY_CHAT_TEMPLATE, "hermes"),
    ("{% if tools %}<tool_call>{{ tools | tojson }}</tool_call>{% endif %}", "hermes"),
    ('{{- "<|start_header_id|>ipython<|end_header_id|>" }} Respond in the format {"name": function name, '
     '"parameters": dictionary of argument name and its value}.', "llama3_json"),
    ("{{ '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("You may call them as [func_name1(params_name1=params_value1), func_name2(params)] "
     "<|python_tag|> ipython", "pythonic"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    ('{{- "[AVAILABLE_TOOLS] " + tools|tojson + "[/AVAILABLE_TOOLS]" }}{{- "[TOOL_CALLS] " + calls|tojson }}', "mistral"),
    (None, "hermes"),
])
def test_auto_picks_the_syntax_from_the_chat_template(template, expected):
    assert get_tool_parser("auto", template).name == expected


def test_unknown_parser_name_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="server.tool_call_parser='granite'.*auto, hermes, llama3_json, pythonic, mistral"):
        get_tool_parser("granite", None)
    assert TOOL_CALL_PARSERS == ("auto", "hermes", "llama3_json", "pythonic", "mistral")


# --- grammars --------------------------------------------------------------------------------

def _function(name, parameters=None) -> dict:
    function = {"name": name, "description": f"{name} tool"}
    return {"type": "function", "function": function | ({"parameters": parameters} if parameters else {})}


TOOLS = [
    _function("get_weather", {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}),
    _function("book_room", {
        "type": "object",
        "properties": {
            "guest": {"type": "object", "additionalProperties": False, "required": ["name"],
                      "properties": {"name": {"type": "string", "maxLength": 6}, "vip": {"type": "boolean"}}},
            "nights": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]}},
        "required": ["guest", "nights"], "additionalProperties": False}),
    _function("ping"),
]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for tool in TOOLS}
EOS = 257


class _ByteTokenizer:
    """Token ids 0-255 are the bytes; 256 bos, 257 eos, 258 pad."""
    eos_token_id, bos_token_id = EOS, 256
    tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>", b"<pad>"]
    special_token_ids = [256, 257, 258]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


@pytest.fixture(scope="module")
def byte_tokenizer():
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()), n_vocab=259)


def _random_walk(matcher: "llguidance.LLMatcher", rng: random.Random, max_tokens: int = 1500) -> str:
    """Bytes the grammar allows, each token drawn uniformly from those allowed, until EOS."""
    bitmask = llguidance.numpy.allocate_token_bitmask(1, 259)
    out = []
    for _ in range(max_tokens):
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
        allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:259])
        token = int(rng.choice(allowed))
        if token == EOS:
            return bytes(out).decode()
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    raise AssertionError(f"no EOS after {max_tokens} tokens: {bytes(out)!r}")


SEPARATORS = {"hermes": r"<tool_call>\n|\n</tool_call>(\n(?=<))?", "llama3_json": ";", "pythonic": ", ",
              "mistral": ", "}


def _without_strings_and_separators(syntax: str, output: str) -> str:
    return re.sub(SEPARATORS[syntax], "#", re.sub(r'"(?:[^"\\]|\\.)*"', '""', output))


@pytest.mark.parametrize("syntax", SYNTAXES)
@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", True), ("required", False), ({"type": "function", "function": {"name": "book_room"}}, True)])
def test_grammar_walks_parse_into_valid_calls(byte_tokenizer, syntax, tool_choice, parallel):
    parser = get_tool_parser(syntax, None)
    grammar = tool_call_grammar(parser, TOOLS, tool_choice, parallel)
    matcher = llguidance.LLMatcher(byte_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    allowed = ["book_room"] if isinstance(tool_choice, dict) else list(SCHEMAS)
    rng, counts = random.Random(f"{syntax}{tool_choice}{parallel}"), set()
    for _ in range(60):
        matcher.reset()
        output = _random_walk(matcher, rng)
        parsed = parser.parse(output)
        assert parsed.content is None, output
        assert len(parsed.tool_calls) >= 1, output
        counts.add(len(parsed.tool_calls))
        for call in parsed.tool_calls:
            assert call.name in allowed, output
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert not re.search(r"\s", _without_strings_and_separators(syntax, output)), output  # compact
    assert (max(counts) > 1) == (parallel and tool_choice == "required")


def test_pythonic_grammar_writes_optional_arguments_only_with_their_commas(byte_tokenizer):
    parameters = {"type": "object", "properties": {
        "a": {"enum": [1]}, "b": {"enum": [2]}, "c": {"enum": [3]}, "d": {"enum": [4]}}, "required": ["b", "d"]}
    parser = get_tool_parser("pythonic", None)
    grammar = tool_call_grammar(parser, [_function("f", parameters)], "required", False)
    matcher = llguidance.LLMatcher(byte_tokenizer, grammar, log_level=0)
    rng, seen = random.Random(1), set()
    for _ in range(60):
        matcher.reset()
        seen.add(_random_walk(matcher, rng))
    assert seen == {"[f(b=2, d=4)]", "[f(a=1, b=2, d=4)]", "[f(b=2, c=3, d=4)]", "[f(a=1, b=2, c=3, d=4)]"}


@pytest.mark.parametrize("tool_choice, message", [
    ({"type": "function", "function": {"name": "send_mail"}}, "'send_mail', which is not among the tools"),
    ("auto", "needs no grammar"),
])
def test_grammar_refuses_a_tool_choice_it_cannot_enforce(tool_choice, message):
    with pytest.raises(ValueError, match=message):
        tool_call_grammar(get_tool_parser("hermes", None), TOOLS, tool_choice, True)


def test_grammar_refuses_tools_the_syntax_cannot_write():
    with pytest.raises(ValueError, match="with a name matching"):
        tool_call_grammar(get_tool_parser("hermes", None), [_function('say "hi"')], "required", True)
    with pytest.raises(ValueError, match="'get-weather' is not a Python identifier"):
        tool_call_grammar(get_tool_parser("pythonic", None), [_function("get-weather")], "required", True)
    keyword_argument = {"type": "object", "properties": {"from": {"type": "string"}}}
    with pytest.raises(ValueError, match="'from' is not a Python identifier"):
        tool_call_grammar(get_tool_parser("pythonic", None), [_function("f", keyword_argument)], "required", True)
    with pytest.raises(ValueError, match="can only write parameters schemas"):
        tool_call_grammar(get_tool_parser("pythonic", None), [_function("f", {"anyOf": [{}]})], "required", True)
    with pytest.raises(ValueError, match="tools.0 must be"):
        tool_call_grammar(get_tool_parser("hermes", None), [_function("f", {"type": "string"})], "required", True)


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_calls_written_into_a_conversation_read_back_as_the_same_calls(syntax):
    """server.tool_prompt_fallback writes an assistant turn's calls in the parser's syntax (tool_prompt)."""
    from jaxcb.server.tool_prompt import calls_text

    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
             {"function": {"name": "ping", "arguments": {}}}]
    parsed = get_tool_parser(syntax, None).parse(calls_text(syntax, calls))
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "days": 3}), ("ping", {})]
