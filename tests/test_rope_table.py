"""The engine reads rotary angles from a per-position table: the same values, and no cos/sin in the step."""

import jax.numpy as jnp
import numpy as np

from engine_factory import generate_first_completions, shared_engine
from jaxcb.config import compose_config
from jaxcb.model.config import resolve_llama_config
from jaxcb.model.llama import build_rope_table, rope_angles, rope_inv_freq
from jaxcb.sampling_params import SamplingParams


def test_the_table_holds_the_angles_the_step_would_compute_bit_for_bit():
    cfg = resolve_llama_config(compose_config(["model=tiny"]).model)
    positions = jnp.asarray([0, 1, 7, 63, 64, 511, 2047], jnp.int32)
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    computed = rope_angles(positions, inv_freq)
    table = build_rope_table(cfg, 2048)
    looked_up = jnp.take(table, positions, axis=1, mode="clip")  # what `forward` does
    for want, got in zip(computed, looked_up):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Padding tokens may carry a position past the table: clipped to its last row, never NaN.
    past = jnp.take(table, jnp.asarray([5000], jnp.int32), axis=1, mode="clip")
    np.testing.assert_array_equal(np.asarray(past[0]), np.asarray(looked_up[0][-1:]))


def test_the_engine_step_evaluates_no_cos_or_sin():
    e = shared_engine()
    generate_first_completions(e, ["a rotary test"], SamplingParams(max_tokens=3, temperature=0.0))
    assert e.runner.compiled
    for executable in e.runner.compiled.values():
        text = executable.as_text()
        assert " cosine(" not in text and " sine(" not in text
