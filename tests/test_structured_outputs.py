"""Structured outputs and token constraints on the random tiny model, where only the grammar can keep
output valid: JSON schemas, regexes and choices always match; constrained rows batched with
unconstrained ones give each row's solo output; async scheduling changes nothing; nothing recompiles."""

import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from engine_factory import VARIANTS, shared_engine as _shared_engine
from jaxcb import SamplingParams
from jaxcb.errors import InvalidRequestError
from jaxcb.structured import StructuredOutputs, from_response_format, from_structured_outputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
}


def shared_engine(*overrides: str):
    return _shared_engine(*VARIANTS, *overrides)


def generate_first_completions(e, prompts: list, params: list) -> list:
    """Each prompt's first completion with its own params, running the engine until all finish."""
    ids = [e.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while e.has_unfinished_requests():
        done.update({out.request_id: out.outputs[0] for out in e.step() if out.finished})
    return [done[i] for i in ids]


def constrained(spec: StructuredOutputs, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 96), temperature=1.0, seed=seed, structured_outputs=spec, **kw)


def test_json_schema_outputs_always_validate_and_stop_on_a_random_model():
    e = shared_engine()
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    outs = generate_first_completions(e, ["Who is it?"] * 24, [constrained(spec, s) for s in range(24)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, PERSON)
        assert set(value) <= set(PERSON["properties"])  # strict: no other properties
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', out.text))  # no whitespace outside strings
    assert e.num_recompiles == 0
    assert e.block_pool.num_free_blocks == e.block_pool.num_blocks - 1


def test_json_object_outputs_parse_as_objects():
    e = shared_engine()
    spec = from_response_format({"type": "json_object"})
    for out in generate_first_completions(e, ["x"] * 6, [constrained(spec, s, max_tokens=200) for s in range(6)]):
        if out.finish_reason == "stop":  # an unbounded object may run to max_tokens on a random model
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")


def test_choice_and_regex_always_match():
    e = shared_engine()
    choices = ["yes", "no", "maybe not"]
    pattern = r"[a-c]{2,4}-[0-9]{2}(\.[0-9])?"
    params = ([constrained(from_structured_outputs({"choice": choices}), s) for s in range(12)]
              + [constrained(from_structured_outputs({"regex": pattern}), s) for s in range(12)])
    outs = generate_first_completions(e, ["q"] * 24, params)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs[:12])
    assert all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in outs[12:])
    assert len({o.text for o in outs[:12]}) > 1  # random, yet always one of them


def test_a_grammar_in_gbnf_is_followed():
    e = shared_engine()
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = generate_first_completions(e, ["sum"] * 8, [constrained(from_structured_outputs({"grammar": grammar}), s)
                                                      for s in range(8)])
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.text), out.text


def _solo_and_batched(e, prompts, params):
    solo = [generate_first_completions(e, [p], [sp])[0] for p, sp in zip(prompts, params)]
    batched = generate_first_completions(e, prompts, params)
    return solo, batched


def test_constrained_and_unconstrained_rows_batched_give_each_rows_solo_output():
    e = shared_engine()
    spec = from_structured_outputs({"json": PERSON})
    prompts = ["alpha", "beta gamma", "delta", "epsilon zeta eta"]
    params = [constrained(spec, 1), SamplingParams(max_tokens=24, temperature=1.0, seed=2),
              constrained(from_structured_outputs({"regex": "[0-9]{4}"}), 3), SamplingParams(max_tokens=24, temperature=0)]
    solo, batched = _solo_and_batched(e, prompts, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in solo]
    assert e.num_recompiles == 0


def test_async_scheduling_gives_the_same_constrained_outputs():
    spec = from_structured_outputs({"json": PERSON})
    params = [constrained(spec, s) for s in range(4)] + [SamplingParams(max_tokens=30, temperature=1.0, seed=9)]
    prompts = [f"prompt {i}" for i in range(5)]
    on = generate_first_completions(shared_engine(), prompts, params)
    off = generate_first_completions(shared_engine("engine.async_scheduling=false"), prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_under_async_scheduling_unconstrained_rows_advance_every_step_and_constrained_ones_every_other():
    e = shared_engine()
    assert e.cfg.engine.async_scheduling
    steps: list[set] = []
    dispatch = e.runner.dispatch

    def recording(out):
        steps.append({s.seq_id[0] for s in out.scheduled})
        return dispatch(out)

    e.runner.dispatch = recording
    try:
        free = e.add_request("free", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        held = e.add_request("held", constrained(from_structured_outputs({"regex": "[a-z]{60}"}), 0, max_tokens=40))
        while e.has_unfinished_requests():
            e.step()
    finally:
        e.runner.dispatch = dispatch
    decode = steps[1:]  # after the step that prefilled both
    both = [s for s in decode if held in s or free in s][: 30]
    assert all(free in s for s in both)  # the unconstrained row never waits
    held_steps = [held in s for s in both]
    assert not any(a and b for a, b in zip(held_steps, held_steps[1:]))  # never two steps in a row
    assert sum(held_steps) >= len(both) // 2 - 1  # but every other one


def test_logit_bias_of_100_makes_greedy_output_that_token():
    e = shared_engine()
    token = ord("q")
    [out] = generate_first_completions(e, ["hello"], [SamplingParams(max_tokens=8, temperature=0,
                                                                     logit_bias={token: 100.0})])
    assert out.token_ids == [token] * 8
    [down] = generate_first_completions(e, ["hello"], [SamplingParams(max_tokens=8, temperature=0,
                                                                      logit_bias={t: -100.0 for t in out.token_ids})])
    assert token not in down.token_ids


def test_bad_words_never_appear_and_allowed_token_ids_are_all_that_appear():
    e = shared_engine()
    plain = generate_first_completions(e, ["abc"] * 4, [SamplingParams(max_tokens=40, temperature=0.8, seed=s)
                                                       for s in range(4)])
    # ban words the unconstrained output does contain
    words = sorted({o.text[i : i + 2] for o in plain for i in range(0, 6, 2) if o.text[i : i + 2].isprintable()
                    and len(o.text[i : i + 2].encode()) == 2})[:4]
    assert words
    banned = generate_first_completions(e, ["abc"] * 4, [SamplingParams(max_tokens=40, temperature=0.8, seed=s,
                                                                        bad_words=words) for s in range(4)])
    for out in banned:
        assert not any(w in out.text for w in words), (words, out.text)
    allowed = [ord(c) for c in "xyz "]
    outs = generate_first_completions(e, ["abc"] * 3, [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                                                      allowed_token_ids=allowed) for s in range(3)])
    assert all(set(o.token_ids) <= set(allowed) for o in outs)


@pytest.mark.parametrize("fields, named", [
    (dict(allowed_token_ids=[ord("b")], bad_words=["b"]), "bad_words"),
    (dict(allowed_token_ids=[ord("b")], structured_outputs={"regex": "a+"}), "allowed_token_ids"),
    (dict(allowed_token_ids=["eos"], min_tokens=3), "min_tokens"),
])
def test_constraints_that_allow_no_first_token_are_refused_naming_a_field(fields, named):
    # The step drew token 0 from an all-masked row before: NUL characters, or an "abort" after one.
    e = shared_engine()
    if fields.get("allowed_token_ids") == ["eos"]:
        fields = dict(fields, allowed_token_ids=list(e.eos_token_ids))
    with pytest.raises(InvalidRequestError, match="allow") as info:
        e.add_request("abc", SamplingParams(max_tokens=5, temperature=1.0, seed=0, **fields))
    assert info.value.field == named
    assert not e.has_unfinished_requests() and not e.scheduler.waiting


@pytest.mark.parametrize("field, value", [("min_tokens", 3), ("ignore_eos", True)])
def test_min_tokens_and_ignore_eos_under_a_grammar_are_refused_by_name(field, value):
    # The grammar's end stopped the reply regardless: "a" with finish_reason stop for min_tokens=3.
    with pytest.raises(InvalidRequestError, match=f"{field} cannot be honoured under a grammar") as e:
        SamplingParams(structured_outputs={"choice": ["a"]}, **{field: value})
    assert e.value.field == field


def test_constraints_that_run_out_of_tokens_later_end_the_sequence_without_a_token_not_the_models():
    # "ab" by the grammar, but only "a" allowed: after "a" no token fits; nothing more is emitted.
    e = shared_engine()
    [out] = generate_first_completions(e, ["abc"], [SamplingParams(
        max_tokens=5, temperature=1.0, seed=0, structured_outputs={"regex": "ab"}, allowed_token_ids=[ord("a")])])
    assert out.text == "a" and out.token_ids == [ord("a")] and out.finish_reason == "abort"
    assert e.block_pool.num_free_blocks == e.block_pool.num_blocks - 1


def test_a_schema_that_does_not_compile_is_refused_naming_its_field_with_nothing_queued():
    e = shared_engine()
    bad = from_structured_outputs({"regex": "(unclosed"})
    with pytest.raises(InvalidRequestError, match="structured_outputs.regex") as info:
        e.add_request("x", constrained(bad, 0))
    assert info.value.field == "structured_outputs.regex"
    assert not e.has_unfinished_requests() and not e.scheduler.waiting


def test_a_grammar_compiling_past_the_limit_is_refused(monkeypatch):
    e = shared_engine()
    compile_one = e.grammars._compile
    released = threading.Event()

    def slow_compile(spec):  # a compile that outlasts the limit on any machine, however fast
        released.wait(30)
        return compile_one(spec)

    monkeypatch.setattr(e.grammars, "_compile", slow_compile)
    monkeypatch.setattr(e.grammars, "max_compile_s", 0.05)
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}x"}
                                            for i in range(60)}}
    try:
        with pytest.raises(InvalidRequestError, match="engine.max_grammar_compile_s"):
            e.add_request("x", constrained(from_structured_outputs({"json": big}), 0))
    finally:
        released.set()
    assert not e.has_unfinished_requests() and not e.scheduler.waiting


def test_compiled_grammars_are_cached_by_schema():
    e = shared_engine()
    spec = from_structured_outputs({"choice": ["cached-a", "cached-b"]})
    generate_first_completions(e, ["a", "b", "c"], [constrained(spec, s) for s in range(3)])
    generate_first_completions(e, ["d"], [constrained(spec, 4)])
    assert e.grammars.num_compiled[(spec.kind, spec.text)] == 1


def test_an_engine_without_masked_variants_refuses_constraints_by_name():
    e = shared_engine("engine.masked_sampling=false")
    for params, name in [(constrained(from_structured_outputs({"choice": ["a"]}), 0), "structured outputs"),
                         (SamplingParams(logit_bias={1: 2.0}), "logit_bias"), (SamplingParams(bad_words=["x"]), "bad_words")]:
        with pytest.raises(InvalidRequestError, match=f"{name}.*engine.masked_sampling=true"):
            e.add_request("x", params)
    assert not e.has_unfinished_requests()


def test_job_records_take_structured_outputs_and_report_a_bad_schema_as_an_error_record(tmp_path):
    from jaxcb.engine import LLM
    from jaxcb.jobs import generate_results, read_input

    llm = LLM.__new__(LLM)
    llm.engine = shared_engine()
    records = [
        {"id": "choice", "prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": 1,
         "structured_outputs": {"choice": ["alpha", "beta"]}},
        {"id": "schema", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 96, "temperature": 1.0,
         "seed": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
        {"id": "bias", "prompt": "x", "max_tokens": 3, "temperature": 0, "logit_bias": {str(ord("k")): 100}},
        {"id": "bad", "prompt": "x", "structured_outputs": {"regex": "(unclosed"}},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    results = {r["id"]: r for r in generate_results(llm, read_input(str(path)), max_in_flight=4)}
    assert results["choice"]["text"] in ("alpha", "beta")
    jsonschema.validate(json.loads(results["schema"]["text"]), PERSON)
    assert results["bias"]["text"] == "kkk"
    assert "structured_outputs.regex" in results["bad"]["error"]
    assert not llm.engine.has_unfinished_requests()


def test_eos_is_allowed_only_where_the_grammar_accepts():
    from jaxcb.structured import TokenConstraint, bitmask_words

    e = shared_engine()
    [eos] = e.eos_token_ids
    grammar = e.grammars.compile(from_structured_outputs({"choice": ["ab", "abc"]}))
    c = TokenConstraint(e.model_config.vocab_size, grammar=grammar.matcher())
    row = np.zeros(bitmask_words(e.model_config.vocab_size), np.int32)

    def allowed() -> set[int]:
        c.fill(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        return set(np.nonzero(bits)[0].tolist())

    assert allowed() == {ord("a")}  # not EOS: nothing is accepted yet
    assert c.accept(ord("a")) is None and allowed() == {ord("b")}
    assert c.accept(ord("b")) is None and allowed() == {ord("c"), eos}  # "ab" is complete: EOS allowed
    assert c.accept(ord("c")) is None and c.is_terminated
    assert c.accept(ord("x")) is not None  # a token the grammar never allowed is an error, not a silent pass


def test_sampling_params_take_vllms_dict_form_of_structured_outputs():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == from_structured_outputs({"choice": ["a", "b"]})
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})


def test_a_request_whose_host_side_work_fails_ends_alone_and_the_engine_goes_on(caplog):
    """A request's detokenizer or token constraint raising (a library's bug, say) aborts that request,
    logged; the others in the batch, and the engine, go on, and every block comes back."""
    engine = shared_engine()
    free = engine.block_pool.num_free_blocks
    greedy = SamplingParams(temperature=0, max_tokens=6)
    masked = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=list(range(10, 200)))
    expected = dict(zip(("plain", "masked"), (
        o.token_ids for o in generate_first_completions(engine, [[3, 4, 5]] * 2, [greedy, masked]))))

    def fail(*_):
        raise RuntimeError("a library bug")

    for rid, params in (("plain", greedy), ("masked", masked), ("bad-detokenizer", greedy), ("bad-mask", masked)):
        engine.add_request([3, 4, 5], params, request_id=rid)
    group = engine.output.groups
    group["bad-detokenizer"].completions[0].detokenizer.add_token = fail
    group["bad-mask"].seqs[0].constraint.fill = fail
    done = {}
    with caplog.at_level("ERROR"):
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert {rid: done[rid].finish_reason for rid in done} == {
        "plain": "length", "masked": "length", "bad-detokenizer": "abort", "bad-mask": "abort"}
    assert done["plain"].token_ids == expected["plain"] and done["masked"].token_ids == expected["masked"]
    assert done["bad-mask"].token_ids == []  # the row's draw was not the model's under its mask: never shown
    failed = [r.getMessage() for r in caplog.records if "it ends here" in r.getMessage()]
    assert any("bad-detokenizer" in m for m in failed) and len(failed) == 2
    assert engine.block_pool.num_free_blocks == free
