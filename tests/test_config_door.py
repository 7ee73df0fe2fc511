"""Bad values found by trying every knob of every group: each is refused at start-up with a sentence
naming the knob, not a traceback from deep inside the engine or a value silently taken as another."""

import pytest

from engine_factory import BASE
from jaxcb.config import ConfigError, compose_config


@pytest.mark.parametrize("override, message", [
    # Divisions by zero, logs of a non-positive number or NaN frequencies in the RoPE tables.
    ("model.rope_scaling={rope_type:llama3,factor:0}", r"^model\.rope_scaling\.factor=0\.0 must be > 0"),
    ("model.rope_scaling={rope_type:linear,factor:-2}", r"^model\.rope_scaling\.factor=-2\.0 must be > 0"),
    ("model.rope_scaling={rope_type:llama3,low_freq_factor:0}",
     r"^model\.rope_scaling\.low_freq_factor=0\.0 and high_freq_factor=4\.0 must satisfy 0 < low_freq_factor"),
    ("model.rope_scaling={rope_type:llama3,low_freq_factor:4,high_freq_factor:4}",
     r"^model\.rope_scaling\.low_freq_factor=4\.0 and high_freq_factor=4\.0 must satisfy"),
    ("model.rope_scaling={rope_type:yarn,original_max_position_embeddings:0}",
     r"^model\.rope_scaling\.original_max_position_embeddings=0 must be >= 1"),
    ("model.rope_scaling={rope_type:yarn,beta_fast:0,beta_slow:0}",
     r"^model\.rope_scaling\.beta_fast=0\.0 and beta_slow=0\.0 must satisfy 0 < beta_slow <= beta_fast"),
    ("model.rope_scaling={rope_type:yarn,beta_fast:1,beta_slow:32}",
     r"^model\.rope_scaling\.beta_fast=1\.0 and beta_slow=32\.0 must satisfy 0 < beta_slow <= beta_fast"),
    ("model.rope_scaling={rope_type:yarn,attention_factor:0}",
     r"^model\.rope_scaling\.attention_factor=0\.0 must be > 0, or null"),
    # The packed matmul's RoPE refused it with a ValueError at the first compile.
    ("model.head_dim=15", r"^model\.head_dim=15 must be even"),
    # A negative end-of-sequence id is never drawn: it was taken without a word.
    ("model.eos_token_ids=[257,-1]", r"^model\.eos_token_ids=\[257, -1\] holds \[-1\]: token ids are >= 0"),
])
def test_a_model_knob_out_of_its_range_is_refused_naming_it(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(BASE + (override,))


@pytest.mark.parametrize("override, differ", [
    ("model.architecture=gemma2", r"model\.embed_scale=None, model\.norm_offset=None, model\.sandwich_norms=None, "
                                  r"model\.hidden_act=None"),
    ("model.architecture=qwen2", r"model\.qkv_bias=None"),
])
def test_a_family_name_on_random_weights_whose_fields_are_llamas_is_refused_naming_them(override, differ):
    # The tiny Llama was built and served as before, only logged under the family's name.
    with pytest.raises(ConfigError, match=rf"^model\.architecture=\w+ but {differ}: with random weights the fields"):
        compose_config(BASE + (override,))


def test_sliding_layers_without_a_window_are_refused_naming_both():
    # sliding_window=0 is no window: the layers listed as sliding ran full attention.
    with pytest.raises(ConfigError, match=r"^model\.layer_types has sliding_attention layers but model\.sliding_window=0"):
        compose_config(BASE + ("model.layer_types=[sliding_attention,full_attention,full_attention]",
                               "model.sliding_window=0"))


def test_the_draft_models_rope_scaling_is_checked_as_the_served_models_is():
    with pytest.raises(ConfigError, match=r"^speculative\.draft_model's rope_scaling\.beta_fast=0\.0 and beta_slow"):
        compose_config(BASE + ("speculative.method=draft",
                               "speculative.draft_model={name:tiny,rope_scaling:{rope_type:yarn,beta_fast:0,beta_slow:0}}"))


@pytest.mark.parametrize("override, message", [
    ("model.name=", r"^model\.name='' is empty; give a name"),
    ("engine.compilation_cache_dir=", r"^engine\.compilation_cache_dir='' is empty; give a folder, or null"),
    ("server.host=", r"^server\.host='' is empty; give the address to listen on"),
    ("server.served_model_name=", r"^server\.served_model_name='' is empty; give the name requests give, or null"),
    ("server.api_key=", r"^server\.api_key='' is empty; give a key, or null"),
    ("ray.address=", r"^ray\.address='' is empty; give auto or ray://HOST:10001"),
])
def test_an_empty_text_knob_is_refused_naming_it_not_taken_as_its_default(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(BASE + (override,))


def test_a_prefill_chunk_cap_with_chunked_prefill_off_is_refused_naming_both():
    # The cap chunked the prompts that enable_chunked_prefill=false was set to run whole.
    with pytest.raises(ConfigError, match=r"^scheduler\.long_prefill_token_threshold=16 splits prefills into chunks, "
                                          r"but scheduler\.enable_chunked_prefill=false"):
        compose_config(BASE + ("scheduler.enable_chunked_prefill=false", "scheduler.long_prefill_token_threshold=16"))


@pytest.mark.parametrize("address", ["nohost", "", "127.0.0.1:0", ":1234", "host:99999"])
def test_a_coordinator_address_that_is_not_host_and_port_is_refused_naming_it(address):
    # JAX answered an IndexError (no port), a ValueError (empty), or waited minutes to reach port 0.
    with pytest.raises(ConfigError, match=r"^engine\.distributed\.coordinator_address=.* must be HOST:PORT"):
        compose_config(BASE + (f"engine.distributed.coordinator_address={address}",
                               "engine.distributed.num_processes=1", "engine.distributed.process_id=0"))


def test_a_speculation_back_off_bar_no_verify_step_can_meet_is_refused_naming_it():
    # A verify step accepts at most num_speculative_tokens: above it, every sequence backed off, without a word.
    with pytest.raises(ConfigError, match=r"^speculative\.min_mean_accepted=5\.0 must be in "
                                          r"0\.\.speculative\.num_speculative_tokens=4"):
        compose_config(BASE + ("speculative.method=ngram", "speculative.min_mean_accepted=5"))


def test_a_batch_dir_under_a_file_is_refused_naming_it_not_a_500_at_the_first_upload(tmp_path):
    (tmp_path / "notes").write_text("a file, not a folder")
    with pytest.raises(ConfigError, match=r"^server\.batch_dir=.*/notes/batches cannot be a folder: .*/notes is a file"):
        compose_config(BASE + (f"server.batch_dir={tmp_path}/notes/batches",))


@pytest.mark.parametrize("override, message", [
    # Each widens every step's sampler inputs: a huge one ran out of memory (numpy's MemoryError) at the first step.
    ("engine.max_stop_token_ids=1000000000000",
     r"^engine\.max_stop_token_ids=1000000000000 must be <= the model's vocabulary of 259 tokens"),
    ("engine.max_logit_bias=1000000000000",
     r"^engine\.max_logit_bias=1000000000000 must be <= the model's vocabulary of 259 tokens .*, or 300"),
])
def test_a_sampler_width_past_the_vocabulary_is_refused_at_start_up_naming_it(override, message):
    from jaxcb.engine import Engine

    with pytest.raises(ConfigError, match=message):
        Engine(compose_config(BASE + (override,)), compile_buckets=False, progress=False)


def test_random_weights_past_the_machines_memory_are_refused_naming_the_sizes_not_an_xla_out_of_memory():
    from jaxcb.engine import Engine

    with pytest.raises(ConfigError, match=r"^model=tiny \(random float32 weights of model\.hidden_size, "
                                          r"intermediate_size, num_layers and vocab_size\) takes .* GiB of host memory"):
        Engine(compose_config(BASE + ("model.num_layers=100000000",)), compile_buckets=False, progress=False)


def test_the_values_next_to_the_refused_ones_still_start():
    from jaxcb.engine import Engine

    Engine(compose_config(BASE + ("engine.max_stop_token_ids=259", "engine.max_logit_bias=300",
                                  "model.rope_scaling={rope_type:yarn,factor:4,beta_fast:1,beta_slow:1}",
                                  "server.host=0.0.0.0", "server.api_key=k")), compile_buckets=False, progress=False)


def test_the_servers_socket_is_bound_before_the_model_loads_and_a_bad_host_or_port_is_named():
    """As vLLM binds first: a port in use or a host not of this machine is a sentence at once, never after a
    start-up's compiles (serve() binds, then builds the app)."""
    import socket

    from jaxcb.server import run

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^server\.port={port} on server\.host='127\.0\.0\.1' is in use"):
            run.bind_listeners("127.0.0.1", port)
        built = []
        cfg = compose_config(BASE + ("server.host=127.0.0.1", f"server.port={port}"))
        original, run.build_app = run.build_app, lambda *a: built.append(a)
        try:
            with pytest.raises(ConfigError, match="is in use by another process"):
                run.serve(cfg)
        finally:
            run.build_app = original
        assert built == []  # refused before anything was built
    with pytest.raises(ConfigError, match=r"^server\.host='no-such-host\.invalid' does not resolve"):
        run.bind_listeners("no-such-host.invalid", 8000)
    with pytest.raises(ConfigError, match=r"^server\.host='192\.0\.2\.1' is not an address of this machine"):
        run.bind_listeners("192.0.2.1", 8000)  # TEST-NET-1: no machine's own address
    [listener] = run.bind_listeners("127.0.0.1", 0)
    assert listener.getsockname()[0] == "127.0.0.1"
    try:  # a second server started on the same port at the same moment is refused at once too
        with pytest.raises(ConfigError, match="is in use by another process"):
            run.bind_listeners("127.0.0.1", listener.getsockname()[1])
    finally:
        listener.close()
    import socket as sockets  # a name with an IPv6 and an IPv4 address: a socket on each (as asyncio binds them)

    both = [(sockets.AF_INET6, sockets.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
            (sockets.AF_INET, sockets.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
    original, sockets.getaddrinfo = sockets.getaddrinfo, lambda *a, **k: both
    try:
        bound = run.bind_listeners("localhost", 0)
    except ConfigError:  # a machine without IPv6's loopback
        bound = []
    finally:
        sockets.getaddrinfo = original
    assert len(bound) in (0, 2) and {s.family for s in bound} <= {sockets.AF_INET6, sockets.AF_INET}
    for s in bound:
        s.close()
