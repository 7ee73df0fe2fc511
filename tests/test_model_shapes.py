"""Architectures build abstractly (no allocation) with the sizes the real models have."""

import jax.numpy as jnp

from jaxcb.model.config import choose_model_dtype, resolve_llama_config
from jaxcb.model.llama import build_abstract_model, count_params
from test_config import compose_config


def test_llama8b_has_8_030_261_248_params_and_128_KiB_of_bf16_kv_per_token():
    cfg = compose_config("model=llama8b", "model.init=random")
    assert cfg.model.dtype == "auto" and choose_model_dtype("auto", None, platform="gpu")[0] == "bfloat16"
    cfg.model.dtype = "bfloat16"  # what auto gives a random-init model on a GPU
    arch = resolve_llama_config(cfg.model)
    model = build_abstract_model(arch)  # nnx.eval_shape: ShapeDtypeStructs, nothing allocated
    assert count_params(model) == 8_030_261_248
    assert arch.kv_bytes_per_token(jnp.dtype(jnp.bfloat16).itemsize) == 131_072
    assert model.embed.dtype == jnp.bfloat16
    assert arch.rope_scaling is not None and arch.rope_scaling.factor == 8.0


def test_llama3_1b_ties_embeddings_and_has_1_2B_params():
    arch = resolve_llama_config(compose_config("model=llama3_1b", "model.init=random").model)
    model = build_abstract_model(arch)
    assert arch.tie_word_embeddings and not hasattr(model, "lm_head")
    assert count_params(model) == 1_235_814_400


def test_llama70b_builds_abstractly():
    arch = resolve_llama_config(compose_config("model=llama70b", "model.init=random").model)
    assert count_params(build_abstract_model(arch)) == 70_553_706_496
