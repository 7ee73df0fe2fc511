"""Tensor parallelism: what can be checked on one device here, and the rest on 8 fake CPU devices
(tests/multi_device/tp_engine_checks.py, in a subprocess)."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from engine_factory import make_engine
from fake_devices import assert_all_passed, run_tests_on_fake_devices
from jaxcb.config import ConfigError, DistributedConfig, compose_config
from jaxcb.sharding import initialize_distributed, param_partition_spec


# On 8 devices every check; on 4, where TP=4 takes all the devices JAX sees, TP=4's logits, greedy
# tokens and cache split (each run compiles its own engines: the whole file twice would cost minutes).
TP4_ON_ALL_DEVICES = "(equal_one_device or kv_cache_is_split) and 4"


@pytest.mark.parametrize("num_devices, select", [(4, TP4_ON_ALL_DEVICES), (8, "")], ids=["4", "8"])
def test_tp2_and_tp4_match_one_device_on_fake_cpu_devices(num_devices, select):
    """Logits and greedy tokens equal TP=1's, every array split as intended, no recompile,
    whether TP=4 takes all the devices JAX sees or half of them."""
    proc = run_tests_on_fake_devices("tests/multi_device/tp_engine_checks.py", num_devices=num_devices, select=select)
    assert_all_passed(proc)
    if select:
        assert proc.stdout.strip().splitlines()[-1].startswith("3 passed"), proc.stdout[-2000:]


def test_tp_size_that_does_not_divide_the_kv_heads_fails_at_start_up_saying_what_to_use():
    # The tiny model has 6 query heads and 2 KV heads.
    with pytest.raises(
        ConfigError,
        match=r"model\.num_kv_heads=2 is not divisible by engine\.tensor_parallel_size=4 \(the KV cache is split by "
        r"KV head\).*use engine\.tensor_parallel_size in \[1, 2\]",
    ):
        make_engine("engine.tensor_parallel_size=4")


def test_tp_size_beyond_the_devices_jax_sees_fails_at_start_up():
    with pytest.raises(ConfigError, match=r"engine\.tensor_parallel_size=2 needs 2 devices but JAX sees 1"):
        make_engine("model.num_heads=8", "model.num_kv_heads=4", "engine.tensor_parallel_size=2")


@pytest.mark.parametrize(
    "name, shape, spec",
    [
        ("q_proj", (3, 96, 8, 16), P(None, None, "tp", None)),
        ("k_proj", (3, 96, 4, 16), P(None, None, "tp", None)),
        ("o_proj", (3, 8, 16, 96), P(None, "tp", None, None)),
        ("gate_proj", (3, 96, 200), P(None, None, "tp")),
        ("down_proj", (3, 200, 96), P(None, "tp", None)),
        ("lm_head", (96, 264), P(None, "tp")),
        ("lm_head", (96, 259), P()),  # a vocabulary that does not divide stays whole
        ("embed", (264, 96), P()),
        ("final_norm", (96,), P()),
    ],
)
def test_each_parameter_is_split_on_its_megatron_axis(name, shape, spec):
    assert param_partition_spec(name, shape, 4) == spec


def test_distributed_config_reaches_jax_distributed_initialize(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    cfg = compose_config(
        [
            "engine.distributed.coordinator_address=10.0.0.1:1234",
            "engine.distributed.num_processes=2",
            "engine.distributed.process_id=1",
        ]
    )
    assert initialize_distributed(cfg.engine.distributed)
    assert calls == [dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)]


def test_one_host_does_not_initialize_jax_distributed(monkeypatch):
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("initialize called"))
    assert not initialize_distributed(DistributedConfig())


def test_engine_initializes_jax_distributed_before_touching_a_device(monkeypatch):
    import jaxcb.engine

    events = []
    monkeypatch.setattr(jaxcb.engine, "initialize_distributed", lambda cfg: events.append(("init", cfg.process_id)))

    def first_device_use(*args):
        events.append(("devices",))
        raise RuntimeError("stop here")

    monkeypatch.setattr(jaxcb.engine, "make_tensor_parallel", first_device_use)
    cfg = compose_config(
        [
            "engine.distributed.coordinator_address=10.0.0.1:1234",
            "engine.distributed.num_processes=2",
            "engine.distributed.process_id=0",
        ]
    )
    with pytest.raises(RuntimeError, match="stop here"):
        jaxcb.engine.Engine(cfg)
    assert events == [("init", 0), ("devices",)]
