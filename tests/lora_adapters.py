"""Factories for random PEFT LoRA adapters, made with the `peft` library, and the merged references."""

from __future__ import annotations

import copy

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Adapter 1: every projection, one rank and alpha. Adapter 2: what PEFT lets vary -- a per-module rank
# and alpha, rsLoRA scaling, only some layers, k_proj left out.
ADAPTER_1 = dict(r=4, lora_alpha=8, target_modules=ALL_MODULES)
ADAPTER_2 = dict(r=6, lora_alpha=5, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                 rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3}, use_rslora=True,
                 layers_to_transform=[0, 2])


def make_peft_adapter(base, out_dir: str, seed: int, std: float = 0.05, **lora_fields):
    """Save a PEFT LoRA adapter with random A and B (PEFT initialises B to zero) over a copy of the
    transformers model `base`; return the copy with the adapter merged into it (fp32, eval)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(task_type="CAUSAL_LM", **lora_fields))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()


def greedy_tokens(model, prompt: list[int], num_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=num_tokens, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def logprobs(model, ids: list[int]):
    """f32[len(ids), V]: log_softmax of the logits after each token."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()


def base_and_two_adapters(root) -> tuple[str, dict, dict]:
    """A random tiny HF Llama under root/base and ADAPTER_1 / ADAPTER_2 over it: (base dir, {adapter name: dir},
    {None | name: the transformers model with it merged})."""
    from hf_checkpoints import make_hf_llama, write_word_tokenizer

    base_dir = str(root / "base")
    base = make_hf_llama(base_dir)
    write_word_tokenizer(base_dir, 131)
    adapters, merged = {}, {None: base}
    for name, fields, seed in (("a1", ADAPTER_1, 1), ("a2", ADAPTER_2, 2)):
        adapters[name] = str(root / name)
        merged[name] = make_peft_adapter(base, adapters[name], seed, **fields)
    return base_dir, adapters, merged


def merged_from_dir(base, adapter_dir: str):
    """transformers' `base` (copied) with the PEFT adapter in `adapter_dir` loaded as PEFT loads it and merged."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).merge_and_unload().eval()


def weight_deltas(base, merged) -> dict:
    """{HF weight name: f32 merged - base} of every weight the merge changed."""
    before, after = base.state_dict(), merged.state_dict()
    return {k: (after[k] - before[k]).float().numpy() for k in after if not bool((after[k] == before[k]).all())}
