"""Every preset and group composes; typos, bad values and contradictions fail with clear messages."""

import os

import pytest
from hydra import compose, initialize_config_dir

from jaxcb import config
from jaxcb.config import Config, ConfigError
from jaxcb.config_errors import check_overrides

PRESETS = ["tiny", "small", "llama3_1b", "llama8b", "llama70b"]


def compose_config(*overrides: str) -> Config:
    return config.compose_config(overrides)


def test_default_config_is_the_tiny_model_with_random_weights():
    cfg = compose_config()
    assert cfg.model.name == "tiny" and cfg.model.init == "random"
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)
    assert cfg.cache.block_size == 16


@pytest.mark.parametrize("preset", PRESETS)
def test_every_model_preset_composes_with_random_init(preset):
    cfg = compose_config(f"model={preset}", "model.init=random")
    assert cfg.model.name == preset
    assert cfg.model.num_heads % cfg.model.num_kv_heads == 0


def test_every_group_has_a_default_and_is_typed():
    cfg = compose_config()
    for group in ("model", "cache", "scheduler", "engine", "server", "job", "ray"):
        assert type(getattr(cfg, group)).__name__.endswith("Config")
    for group in ("model", "cache", "scheduler", "engine", "server", "job", "ray"):
        assert os.path.isdir(os.path.join(config.CONF_DIR, group))


def test_hf_preset_reads_architecture_from_checkpoint(tmp_path):
    from hf_checkpoints import make_hf_llama
    from jaxcb.model.config import resolve_llama_config

    make_hf_llama(str(tmp_path))
    cfg = compose_config("model=hf", f"model.checkpoint={tmp_path}")
    arch = resolve_llama_config(cfg.model)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (48, 3, 6, 2)


def test_hf_preset_serves_a_float32_checkpoint_in_float32_on_cpu_and_the_checkpoints_dtype_elsewhere(tmp_path):
    from hf_checkpoints import make_hf_llama
    from jaxcb.model.config import choose_model_dtype, resolve_llama_config

    make_hf_llama(str(tmp_path))  # a float32 checkpoint
    cfg = compose_config("model=hf", f"model.checkpoint={tmp_path}")
    assert cfg.model.dtype == "auto" and resolve_llama_config(cfg.model).dtype == "float32"  # this is a CPU
    assert resolve_llama_config(compose_config("model=hf", f"model.checkpoint={tmp_path}",
                                               "model.dtype=bfloat16").model).dtype == "bfloat16"
    for ckpt, want in (("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float16", "float16"), (None, "bfloat16")):
        assert choose_model_dtype("auto", ckpt, platform="gpu")[0] == want
    assert choose_model_dtype("float16", "bfloat16", platform="cpu")[0] == "float16"
    # The log says what auto chose and why.
    assert choose_model_dtype("auto", "float16", platform="gpu") == ("float16", "model.dtype=auto: the checkpoint's float16 on gpu")
    assert "quantized or random" in choose_model_dtype("auto", None, platform="gpu")[1]


@pytest.mark.parametrize("checkpoint", ["bfloat16", None])
def test_auto_dtype_on_cpu_serves_bf16_weights_in_bf16_only_where_the_cpu_backend_multiplies_them_fast(checkpoint):
    from jaxcb.model.config import choose_model_dtype

    def auto(speedup, packed=True, ckpt=checkpoint):
        return choose_model_dtype("auto", ckpt, platform="cpu", packed_cpu_backend=packed,
                                  cpu_bf16_speedup=lambda: speedup)

    dtype, why = auto(5.2)
    assert dtype == "bfloat16" and "bf16 matmul runs 5.2x float32's speed" in why
    assert auto(1.0)[0] == "bfloat16"
    dtype, why = auto(0.7)  # a CPU without AMX or fast bf16 dot products
    assert dtype == "float32" and "runs 0.70x float32's speed" in why
    dtype, why = auto(None)  # no C++ compiler: XLA's bf16 dot is slow here
    assert dtype == "float32" and "bf16 matmul is unavailable" in why
    assert auto(5.2, packed=False)[0] == "float32"  # the xla backend, or a family the cpu backend does not run
    for ckpt in ("float32", "float16"):  # transformers' reference precision, and no loss in converting
        assert auto(5.2, ckpt=ckpt)[0] == "float32"


def test_large_preset_without_weights_says_which_option_to_add():
    with pytest.raises(ConfigError, match=r"model\.checkpoint=DIR.*model\.init=random"):
        compose_config("model=llama8b")


def test_hf_preset_without_checkpoint_fails():
    with pytest.raises(ConfigError, match=r"model\.checkpoint=DIR"):
        compose_config("model=hf")


def test_missing_checkpoint_directory_is_named():
    with pytest.raises(ConfigError, match=r"model\.checkpoint=/no/such/dir is not a directory"):
        compose_config("model=llama8b", "model.checkpoint=/no/such/dir")


@pytest.mark.parametrize("overrides, message", [
    # Hydra's own report suggests `+scheduler.max_num_seq=4`, which jaxcb refuses in turn
    (["scheduler.max_num_seq=4"], "scheduler.max_num_seq is not a config field jaxcb knows (did you mean "
                                  "scheduler.max_num_seqs?); the fields are listed in conf/scheduler/"),
    (["foo=1"], "foo is not a config field jaxcb knows; the fields are listed in conf/config.yaml"),
    (["cache.block_size=sixteen"], "cache.block_size: Value 'sixteen' of type 'str' could not be converted to Integer"),
    (["model=llama9b"], "model=llama9b is not a preset (did you mean llama8b?); the presets of model are gemma2_9b, "),
    (["scheduler=fast"], "scheduler=fast is not a preset; the presets of scheduler are default (conf/scheduler/)"),
    (["engine.max_model_len=1,2"], "Ambiguous value for argument 'engine.max_model_len=1,2': for a list write"),
    # a key under a mapping that is null in this preset (OmegaConf's AssertionError before)
    (["model.rope_scaling.factor=4"], "model.rope_scaling.factor: model.rope_scaling has no key factor (or is null); "
                                      "set model.rope_scaling whole, as model.rope_scaling={factor: ...}"),
])
def test_an_override_hydra_cannot_compose_is_one_sentence_naming_it(overrides, message):
    for check in (lambda: check_overrides(overrides), lambda: compose_config(*overrides)):
        with pytest.raises(ConfigError) as refused:
            check()
        assert str(refused.value).startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["engine.max_model_len"], "cannot read the override 'engine.max_model_len': missing EQUAL at '<EOF>'; an "
                               "override is key=value"),
    (["model.name=[1"], "cannot read the override 'model.name=[1': "),
    # a sweep is checked with its first value; the key of every job is the same
    (["-m", "engine.max_model_len=128,256", "scheduler.max_num_seq=3"], "scheduler.max_num_seq is not a config"),
    (["--multirun", "scheduler.max_num_sequences=1,2"], "scheduler.max_num_sequences is not a config field"),
])
def test_a_command_line_hydra_cannot_compose_is_refused_before_hydra_runs(argv, message):
    with pytest.raises(ConfigError) as refused:
        check_overrides(argv)
    assert str(refused.value).startswith(message)


def test_command_lines_that_compose_or_that_hydra_answers_itself_pass_the_check():
    check_overrides(["model=smollm2", "scheduler.max_num_seqs=4", "hydra.run.dir=/tmp/x"])
    check_overrides(["-m", "scheduler.max_num_seqs=4,8", "engine.max_model_len=range(128,512,128)"])
    check_overrides(["--cfg", "job", "scheduler.max_num_seq=3"])  # Hydra prints, and composes, itself


def test_a_yarn_rope_scaling_set_whole_on_a_preset_without_one_is_applied():
    # Qwen's long-context setting; on a preset whose rope_scaling is null OmegaConf could not merge it.
    cfg = compose_config("model=qwen2_5_7b", "model.init=random", "model.rope_scaling={rope_type: yarn, factor: 4.0, "
                         "original_max_position_embeddings: 32768}")
    assert cfg.model.rope_scaling == config.RopeScalingConfig(rope_type="yarn", factor=4.0,
                                                              original_max_position_embeddings=32768)
    llama = compose_config("model=llama8b", "model.init=random", "model.rope_scaling.factor=4")
    assert llama.model.rope_scaling.rope_type == "llama3" and llama.model.rope_scaling.factor == 4.0
    with pytest.raises(ConfigError, match="model.rope_scaling has no field facter; its fields are rope_type, factor"):
        compose_config("model.rope_scaling={facter: 4}")
    with pytest.raises(ConfigError, match="model.rope_scaling.factor: Value 'x' of type 'str' could not be converted"):
        compose_config("model.rope_scaling={factor: x}")


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_8_bit_kv_cache_dtypes_are_accepted(dtype):
    assert compose_config(f"cache.dtype={dtype}").cache.dtype == dtype


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cache.block_size=0"], r"cache\.block_size=0 must be one of \[8, 16, 32, 64\]"),
        (["cache.num_blocks=1"], r"cache\.num_blocks=1 must be >= 2"),
        (["cache.dtype=int4"], r"cache\.dtype='int4' must be one of .*'int8', 'fp8_e4m3', 'fp8_e5m2'"),
        (["cache.dtype=int8", "cache.kv_calibration_tokens=4"], r"cache\.kv_calibration_tokens=4 must be >= 16"),
        (["scheduler.max_num_seqs=0"], r"scheduler\.max_num_seqs=0 must be >= 1"),
        (
            ["scheduler.max_num_batched_tokens=8"],
            r"scheduler\.max_num_batched_tokens=8 must be >= cache\.block_size=16",
        ),
        (
            ["scheduler.max_num_seqs=128", "scheduler.max_num_batched_tokens=64"],
            r"scheduler\.max_num_batched_tokens=64 must be >= scheduler\.max_num_seqs=128",
        ),
        (["scheduler.policy=lifo"], r"scheduler\.policy=.lifo."),
        (["server.port=70000"], r"server\.port=70000"),
        (["model.dtype=float64"], r"model\.dtype='float64'"),
        (["bench.repeats=0"], r"bench\.repeats=0 must be >= 1"),
        (["bench.repeats=3"], r"bench\.repeats=3 repeats bench\.task=flops or policies only; drop it for bench\.task=offline"),
        (["bench.repeats=3", "bench.task=policies", "bench.mode=serving"],
         r"bench\.repeats=3 repeats offline runs only; drop it for bench\.mode=serving"),
        (["model.init=zeros"], r"model\.init='zeros'"),
        (["model.layer_loop=unroll"], r"model\.layer_loop='unroll' must be one of auto, scan, unrolled"),
        (["model.num_kv_heads=4"], r"model\.num_heads=6 must be a multiple of model\.num_kv_heads=4"),
        (["engine.tensor_parallel_size=0"], r"engine\.tensor_parallel_size=0 must be >= 1"),
        (
            ["engine.distributed.coordinator_address=host:1234"],
            r"engine\.distributed\.num_processes, engine\.distributed\.process_id unset",
        ),
        (
            [
                "engine.distributed.coordinator_address=host:1234",
                "engine.distributed.num_processes=2",
                "engine.distributed.process_id=2",
            ],
            r"engine\.distributed\.process_id=2 must be in 0\.\.1",
        ),
        (
            ["engine.max_model_len=4096"],
            r"engine\.max_model_len=4096 must be <= model\.max_position_embeddings=2048",
        ),
        (["engine.huge_pages=always"], r"engine\.huge_pages='always' must be auto .* or off"),
        (["engine.huge_pages_seconds=0"], r"engine\.huge_pages_seconds=0.0 must be > 0 seconds"),
        (["engine.max_stop_token_ids=-1"], r"engine\.max_stop_token_ids=-1 must be >= 0"),
        (["bench.input_mean=0"], r"bench\.input_mean=0.0 must be > 0 tokens"),
        (["bench.output_mean=-5"], r"bench\.output_mean=-5.0 must be > 0 tokens"),
        (["bench.input_sigma=-1"], r"bench\.input_sigma=-1.0 must be >= 0"),
        (["bench.output_sigma=-0.5"], r"bench\.output_sigma=-0.5 must be >= 0"),
        (["bench.url=127.0.0.1:8000"], r"bench\.url='127\.0\.0\.1:8000' must be an http:// or https:// URL"),
        (["bench.workload=file", "bench.file=/no/such/workload.jsonl"],
         r"bench\.file=/no/such/workload\.jsonl is not a file"),
        (["model.max_position_embeddings=0"], r"model\.max_position_embeddings=0 must be >= 1"),
        (["model.vocab_size=1"], r"model\.vocab_size=1 must be >= 2"),
        (["model.query_pre_attn_scalar=-1"], r"model\.query_pre_attn_scalar=-1.0 must be >= 0 \(0: head_dim's\)"),
        (["model.rope_theta=0"], r"model\.rope_theta=0.0 must be > 0"),
        (["model.attn_logit_softcap=-50"], r"model\.attn_logit_softcap=-50.0 must be >= 0 \(0: no cap\)"),
        (["model.final_logit_softcap=-30"], r"model\.final_logit_softcap=-30.0 must be >= 0 \(0: no cap\)"),
        (["model.bos_token_id=1"], r"model\.bos_token_id=1 is not read: the tokenizer's own BOS is used"),
        (["generate.temperature=-1"], r"^generate\.temperature=-1 must be between 0 and 2"),
        (["generate.top_p=0"], r"^generate\.top_p=0 must be in \(0, 1\]"),
        (["speculative.method=draft", "speculative.draft_model={name:tiny,num_heads:5}"],
         r"^speculative\.draft_model's num_heads=5 must be a multiple of speculative\.draft_model's num_kv_heads=2"),
        (["speculative.method=draft", "speculative.draft_model={name:tiny,rope_theta:0}"],
         r"^speculative\.draft_model's rope_theta=0.0 must be > 0"),
    ],
)
def test_bad_values_fail_with_a_sentence_naming_the_fields(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(*overrides)


# What only start-up can check (the model's vocabulary, the machine's memory, `auto` resolved): refused by
# name before anything compiles, most before a weight is read.
@pytest.mark.parametrize("overrides, message", [
    (["engine.max_logprobs=260"], r"^engine\.max_logprobs=260 must be <= the model's vocabulary of 259 tokens"),
    # terabytes: more than any machine this runs on has
    (["cache.host_prefix_cache_gib=100000"], r"^cache\.host_prefix_cache_gib=100000 \(the prefix cache's host tier\) "
                                             r"takes 100000\.00 GiB of host memory, more than the .* this machine has"),
    (["scheduler.preemption_mode=swap", "cache.swap_space_gib=100000"],
     r"^cache\.swap_space_gib=100000 \(swap space\) takes 100000\.00 GiB of host memory, more than the"),
    (["lora.enable=true", "lora.max_loras=100000000"],
     r"^lora\.max_loras=100000000 x lora\.max_rank=16 \(the adapters' slots\) takes .* GiB of host memory, more than"),
    (["lora.enable=true", "lora.max_rank=100000000"],
     r"^lora\.max_loras=4 x lora\.max_rank=100000000 \(the adapters' slots\) takes .* GiB of host memory, more than"),
    (["scheduler.max_num_batched_tokens=10000000000"],
     r"^scheduler\.max_num_batched_tokens=10000000000 and scheduler\.max_num_seqs=8: the largest step's activations "
     r"take .* GiB, more than the .* of host memory available; lower scheduler\.max_num_batched_tokens or"),
    (["scheduler.max_num_batched_tokens=1000000000", "scheduler.max_num_seqs=1000000000"],
     r"^scheduler\.max_num_batched_tokens=1000000000 and scheduler\.max_num_seqs=1000000000: the largest step's"),
    (["scheduler.max_num_batched_tokens=auto", "speculative.method=ngram", "speculative.num_speculative_tokens=600"],
     r"^speculative\.num_speculative_tokens=600 must be below scheduler\.max_num_batched_tokens=auto \(512 here\)"),
])
def test_values_only_start_up_can_check_are_refused_by_name_before_a_compile(overrides, message):
    from engine_factory import make_engine

    with pytest.raises(ConfigError, match=message):
        make_engine(*overrides)


def test_a_compilation_cache_dir_that_cannot_be_created_is_named(tmp_path):
    from jaxcb.engine import compilation_cache_folder

    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=rf"^engine\.compilation_cache_dir={tmp_path}/a-file/xla: .* cannot be "
                                          r"created \(Not a directory\); give a folder"):
        compilation_cache_folder(f"{tmp_path}/a-file/xla")


def test_kv_calibration_tokens_past_max_model_len_are_logged_with_the_number_used(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    import jax.numpy as jnp

    from jaxcb import engine
    from jaxcb.model.config import resolve_llama_config

    class Calibrated(Exception):
        pass

    def calibrate(backend, weights, model_cfg, tokenizer, num_tokens, *rest):
        raise Calibrated(num_tokens)

    monkeypatch.setattr(engine, "calibrated_kv_scales", calibrate)
    cfg = compose_config("cache.dtype=int8", "cache.kv_calibration_tokens=100000")
    plan = SimpleNamespace(dtype=jnp.dtype(jnp.int8), block_size=16)
    with caplog.at_level(logging.INFO, logger="jaxcb.engine"), pytest.raises(Calibrated) as calibrated:
        engine.kv_scales_for(cfg, None, None, resolve_llama_config(cfg.model), None, plan, None, max_model_len=256)
    assert calibrated.value.args == (256,)
    assert "cache.kv_calibration_tokens=100000: 256 used, engine.max_model_len" in caplog.text


def test_preset_that_contradicts_its_checkpoint_lists_the_differences(tmp_path):
    from hf_checkpoints import make_hf_llama
    from jaxcb.model.config import resolve_llama_config

    make_hf_llama(str(tmp_path))
    cfg = compose_config("model=llama3_1b", f"model.checkpoint={tmp_path}")
    with pytest.raises(ConfigError, match=r"model\.hidden_size=2048 but config\.json says 48.*model=hf"):
        resolve_llama_config(cfg.model)


def test_replica_knobs_need_the_ray_backend_and_room_on_the_local_cluster():
    cfg = compose_config("job.backend=ray", "job.num_replicas=4", "server.backend=ray", "server.num_replicas=2")
    assert (cfg.job.num_replicas, cfg.server.num_replicas, cfg.ray.address) == (4, 2, None)
    with pytest.raises(ConfigError, match=r"job\.num_replicas=2 needs job\.backend=ray"):
        compose_config("job.num_replicas=2")
    with pytest.raises(ConfigError, match=r"server\.backend='spark' must be local or ray"):
        compose_config("server.backend=spark")
    with pytest.raises(ConfigError, match=r"needs 4 CPUs but ray\.num_cpus=2; lower ray\.cpus_per_replica"):
        compose_config("server.backend=ray", "server.num_replicas=4", "ray.num_cpus=2")
    with pytest.raises(ConfigError, match=r"job\.batch_size=0 must be >= 1"):
        compose_config("job.batch_size=0")


def test_the_ray_backend_without_ray_says_what_to_install(monkeypatch):
    import sys

    from jaxcb.cli import UserError
    from jaxcb.distributed.ray_cluster import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(UserError, match=r"pip install 'jaxcb\[dist\]'"):
        import_ray()


def test_every_tool_call_parser_the_server_has_is_accepted_by_the_config():
    from jaxcb.server.tool_parsers import TOOL_CALL_PARSERS

    for name in TOOL_CALL_PARSERS:
        assert compose_config(f"server.tool_call_parser={name}").server.tool_call_parser == name


@pytest.mark.parametrize("override, named", [
    ("+scheduler.max_num_seq=4", "scheduler.max_num_seq"),  # what Hydra's own typo message tells a user to write
    ("++engine.foo=1", "engine.foo"),
    ("+foo=1", "foo"),
])
def test_a_key_added_with_a_plus_that_no_config_has_is_refused_by_name(override, named):
    # Hydra adds the key; turning the config into dataclasses dropped it without a word.
    with pytest.raises(ConfigError, match=f"{named} is not a config field jaxcb knows"):
        compose_config(override)


@pytest.mark.parametrize("override, named", [
    ("cache.cpu_kv_cache_gib=inf", "cache.cpu_kv_cache_gib=inf"),  # a traceback in the cache plan before
    ("cache.host_prefix_cache_gib=inf", "cache.host_prefix_cache_gib=inf"),
    ("model.rms_norm_eps=nan", "model.rms_norm_eps=nan"),  # NaN logits, token 0, no error
    ("bench.output_mean=nan", "bench.output_mean=nan"),
])
def test_a_nan_or_infinite_number_in_any_group_is_refused_by_name(override, named):
    with pytest.raises(ConfigError, match=f"{named}: not a finite number"):
        compose_config(override)


@pytest.mark.parametrize("overrides, script, sentence", [
    (["speculative.num_speculative_tokens=8"], "serve",
     "speculative.num_speculative_tokens=8 is not used: speculative.method=none (set ngram or draft to speculate)"),
    (["speculative.method=draft", "speculative.draft_model=tiny", "speculative.prompt_lookup_max=6"], "serve",
     "speculative.prompt_lookup_max=6 is not used: speculative.method=draft (ngram's lookup reads it)"),
    (["scheduler.priority_aging_s=3"], "serve", "scheduler.priority_aging_s=3.0 is not used: scheduler.policy=fcfs"),
    (["cache.swap_space_gib=1"], "serve", "cache.swap_space_gib=1.0 is not used: scheduler.preemption_mode=recompute"),
    (["attention.impl=xla", "attention.interpret=true"], "serve", "attention.interpret=True is not used: attention.impl=xla"),
    (["lora.max_loras=2"], "serve", "lora.max_loras=2 is not used: no adapter is loaded and lora.enable=false"),
    (["job.batch_size=4"], "generate", "job.batch_size=4 is not used: no JSONL job (input= and output=)"),
    (["bench.request_rate=3"], "bench", "bench.request_rate=3.0 is not used: bench.mode=offline (serving mode reads it)"),
    (["bench.output_cap=64"], "bench", "bench.output_cap=64 is not used: bench.workload=lognormal"),
])
def test_a_setting_the_runs_mode_does_not_read_is_named(overrides, script, sentence):
    # Warned about, not refused: a Hydra sweep over the mode keeps the other knobs fixed.
    from jaxcb.config_unused import unused_settings

    assert any(s.startswith(sentence) for s in unused_settings(compose_config(*overrides), script))
    assert unused_settings(compose_config(), script) == []


def test_the_scripts_warn_of_a_setting_their_mode_does_not_read(caplog):
    import logging
    import sys

    from jaxcb.cli import entry_point

    ran = []
    with initialize_config_dir(config_dir=config.CONF_DIR, version_base=None):
        composed = compose("config", overrides=["speculative.num_speculative_tokens=8"])
    caplog.set_level(logging.WARNING, logger="jaxcb")
    saved, sys.argv = sys.argv, ["scripts/serve.py"]
    try:
        entry_point(ran.append)(composed)
    finally:
        sys.argv = saved
    assert len(ran) == 1 and "speculative.num_speculative_tokens=8 is not used" in caplog.text
