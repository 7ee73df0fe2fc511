"""In-jit sampling: each parameter does what it says, and a row's draw depends only on its own key."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.sampling import SamplingArrays, sample

VOCAB = 11


def arrays(rows, **overrides):
    base = dict(
        temperature=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32), repetition_penalty=np.ones(rows, np.float32),
        presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
        seeds=np.arange(rows, dtype=np.uint32), counters=np.zeros(rows, np.int32),
        banned_token_ids=np.full((rows, 2), VOCAB, np.int32),
    )
    base.update({k: np.asarray(v, base[k].dtype) for k, v in overrides.items()})
    any_penalty = bool(np.any(base["repetition_penalty"] != 1) or np.any(base["presence_penalty"] != 0)
                       or np.any(base["frequency_penalty"] != 0))
    any_filter = bool(np.any(base["top_k"] > 0) or np.any(base["top_p"] < 1))
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in base.items()},
                          any_penalty=jnp.asarray(any_penalty), any_filter=jnp.asarray(any_filter))


def draw(logits, s, history=None, num_prompt=None, num_known=None):
    rows = logits.shape[0]
    history = np.zeros((rows, 8), np.int32) if history is None else history
    num_prompt = np.zeros(rows, np.int32) if num_prompt is None else num_prompt
    num_known = np.zeros(rows, np.int32) if num_known is None else num_known
    tok, lp, top_ids, top_lp = sample(jnp.asarray(logits, jnp.float32), s, jnp.asarray(history),
                                      jnp.asarray(num_prompt), jnp.asarray(num_known), 3)
    return np.asarray(tok), np.asarray(lp), np.asarray(top_ids), np.asarray(top_lp)


LOGITS = np.array([[0.0, 1.0, 3.0, 2.9, 2.8, -1.0, 0.5, 0.2, 0.1, 0.0, -2.0]], np.float32)


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    tok, lp, top_ids, top_lp = draw(LOGITS, arrays(1, temperature=[0.0]))
    assert tok[0] == 2
    expected = LOGITS[0] - np.log(np.exp(LOGITS[0]).sum())
    assert np.isclose(lp[0], expected[2], atol=1e-5)
    assert list(top_ids[0]) == [2, 3, 4] and np.allclose(top_lp[0], expected[[2, 3, 4]], atol=1e-5)


def test_top_k_top_p_and_min_p_keep_only_what_they_allow():
    many = np.repeat(LOGITS, 300, axis=0)
    seeds = np.arange(300)
    tok_k, *_ = draw(many, arrays(300, top_k=[2] * 300, seeds=seeds))
    assert set(tok_k) == {2, 3}
    tok_p, *_ = draw(many, arrays(300, top_p=[0.05] * 300, seeds=seeds))
    assert set(tok_p) == {2}
    tok_m, *_ = draw(many, arrays(300, min_p=[0.85] * 300, seeds=seeds))
    assert set(tok_m) <= {2, 3, 4} and len(set(tok_m)) > 1
    tok_all, *_ = draw(many, arrays(300, seeds=seeds))
    assert len(set(tok_all)) > 5  # unfiltered sampling really samples


def test_a_rows_draw_depends_only_on_its_seed_and_counter():
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((5, VOCAB)).astype(np.float32)
    s = arrays(5, seeds=[7, 8, 9, 10, 11], counters=[3, 0, 5, 1, 2], top_k=[0, 3, 0, 0, 4])
    together, *_ = draw(batch, s)
    alone, *_ = draw(batch[2:3], arrays(1, seeds=[9], counters=[5]))
    assert together[2] == alone[0]
    moved, *_ = draw(batch[[4, 2]], arrays(2, seeds=[11, 9], counters=[2, 5], top_k=[4, 0]))
    assert moved[1] == together[2] and moved[0] == together[4]


def test_banned_tokens_are_never_drawn():
    s = arrays(1, temperature=[0.0], banned_token_ids=[[2, 3]])
    tok, *_ = draw(LOGITS, s)
    assert tok[0] == 4


def test_repetition_penalty_applies_to_prompt_and_output_presence_only_to_output():
    history = np.array([[2, 3, 0, 0, 0, 0, 0, 0]], np.int32)  # prompt token 2, output token 3
    rep = arrays(1, temperature=[0.0], repetition_penalty=[2.0])
    tok, *_ = draw(LOGITS, rep, history, num_prompt=np.array([1]), num_known=np.array([2]))
    assert tok[0] == 4  # 3.0 -> 1.5 and 2.9 -> 1.45: 2.8 wins
    presence = arrays(1, temperature=[0.0], presence_penalty=[0.15])
    tok, *_ = draw(LOGITS, presence, history, num_prompt=np.array([1]), num_known=np.array([2]))
    assert tok[0] == 2  # only the output token 3 is penalised; 2 is still best
    freq = arrays(1, temperature=[0.0], frequency_penalty=[2.0])
    history2 = np.array([[5, 2, 0, 0, 0, 0, 0, 0]], np.int32)
    tok, *_ = draw(LOGITS, freq, history2, num_prompt=np.array([1]), num_known=np.array([2]))
    assert tok[0] == 3


def test_skipping_noise_and_top_logprobs_changes_no_greedy_token():
    """The runner clears any_random when every row is greedy and any_logprobs when no row asks
    for logprobs; the tokens and their logprobs must be the same as with both on."""
    logits = np.random.default_rng(0).standard_normal((4, VOCAB)).astype(np.float32)
    full = draw(logits, arrays(4, temperature=[0, 0, 0, 0]))
    s = arrays(4, temperature=[0, 0, 0, 0])
    lean = draw(logits, SamplingArrays(**{**vars(s), "any_random": jnp.asarray(False), "any_logprobs": jnp.asarray(False)}))
    np.testing.assert_array_equal(full[0], lean[0])
    np.testing.assert_array_equal(full[1], lean[1])
    assert np.all(lean[2] == 0) and np.all(lean[3] == 0)


def compiled_sample_hlo(s) -> str:  # the optimised HLO of `sample` over 2 rows
    zeros = jnp.zeros((2,), jnp.int32)
    return (
        jax.jit(lambda lg, s: sample(lg, s, jnp.zeros((2, 8), jnp.int32), zeros, zeros, 3))
        .lower(jnp.zeros((2, VOCAB), jnp.float32), s)
        .compile()
        .as_text()
    )


def test_no_conditional_of_the_step_returns_the_whole_logits():
    """A conditional that returns the [R, V] logits copies them even from the branch that leaves
    them unchanged (~1 ms at 64 rows of a 32k vocab on CPU). The step's conditionals must
    return only per-row results; the penalties and the ban rewrite the logits inside a branch."""
    s = arrays(2, temperature=[0.0, 1.0])
    hlo = compiled_sample_hlo(s)
    entry = re.search(r"^ENTRY [^\n]*\{\n(.*?)^\}", hlo, re.M | re.S).group(1)
    conditionals = re.findall(r"= (.*?) conditional\(", entry)
    assert conditionals, "the step has no conditional at all"
    assert not [shape for shape in conditionals if f"f32[2,{VOCAB}]" in shape], conditionals


def runs_in(hlo: str, op: str) -> tuple[bool, bool]:
    """(whether `op` runs in the step's straight-line code, whether some conditional's branch runs it)."""
    bodies = {m.group(1): m.group(2) for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, re.M | re.S)}
    branches = set()
    for body in bodies.values():
        for m in re.finditer(r"conditional\(.*?branch_computations=\{([^}]*)\}", body):
            branches.update(name.strip().lstrip("%") for name in m.group(1).split(","))

    def reaches(name, seen=()):
        body = bodies.get(name, "")
        if f" {op}(" in body:
            return True
        called = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", body)
        return any(reaches(c, seen + (name,)) for c in called if c not in seen and c not in branches)

    entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
    return reaches(entry), any(reaches(b) for b in branches)


def test_banning_runs_only_in_a_branch_taken_when_some_row_bans_a_token():
    """The ban's scatter copies the whole [R, V] logits, so it must sit in a conditional's
    branch (taken only when some row bans an id), never in the step's straight-line code."""
    every_step, in_a_branch = runs_in(compiled_sample_hlo(arrays(2, temperature=[0.0, 0.0])), "scatter")
    assert in_a_branch, "no branch bans tokens"
    assert not every_step, "the ban's scatter runs on every step"


def test_the_log_softmax_normaliser_runs_only_when_some_row_wants_a_logprob():
    """The normaliser is a max and a sum of exps over the whole [R, V] logits (~1.5 ms a
    64-row step of a 32k vocab on CPU). With no row asking for logprobs it is skipped: the
    tokens are the same and the logprobs 0; with it on, they are log_softmax's."""
    logits = np.random.default_rng(1).standard_normal((4, VOCAB)).astype(np.float32)
    s = arrays(4, temperature=[0, 0, 0, 0])
    full = draw(logits, s)
    lean = draw(logits, SamplingArrays(**{**vars(s), "any_logprobs": jnp.asarray(False),
                                          "any_token_logprob": jnp.asarray(False)}))
    np.testing.assert_array_equal(full[0], lean[0])
    assert np.all(lean[1] == 0) and np.all(lean[2] == 0) and np.all(lean[3] == 0)
    expected = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(full[1], expected[np.arange(4), full[0]], atol=1e-5)
    every_step, in_a_branch = runs_in(compiled_sample_hlo(arrays(2, temperature=[0, 0])), "exponential")
    assert in_a_branch and not every_step


def test_top_k_top_p_without_a_sort_keep_exactly_what_a_sort_keeps():
    from benchmarks.sampling_filter import sorted_filter  # the textbook filter: one descending sort
    from jaxcb.sampling import _filter_top_k_top_p

    rng = np.random.default_rng(0)
    rows, vocab = 48, 997
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * rng.uniform(0.1, 8, (rows, 1)).astype(np.float32)
    logits[0, :50] = 3.0  # ties at the cut
    logits[1] = np.round(logits[1])  # many ties
    logits[2, 10:] = -np.inf  # a row already filtered
    logits[3] = -1e30  # huge negative values
    top_k = rng.integers(0, 60, rows).astype(np.int32)
    top_k[:6] = [1, 0, 5, vocab, vocab + 7, 2]
    top_p = rng.uniform(0.01, 1.0, rows).astype(np.float32)
    top_p[6:10] = [1.0, 1e-6, 0.5, 0.999999]
    s = arrays(rows, top_k=top_k, top_p=top_p)
    ours = np.asarray(jax.jit(lambda x: _filter_top_k_top_p(x, s))(jnp.asarray(logits)))
    theirs = np.asarray(sorted_filter(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))
    np.testing.assert_array_equal(ours[~np.isneginf(ours)], logits[~np.isneginf(ours)])
