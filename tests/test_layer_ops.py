"""The model's layer operations (`jaxcb.model.llama.LayerOps`): every backend provides each operation
the model calls, with the parameters the model passes, and each backend that runs on CPU is one."""

import inspect

import pytest

import jaxcb.backends.cpu  # noqa: F401  (registers CpuBackend among Backend's subclasses)
from jaxcb.backends import Backend, select_backend
from jaxcb.config import AttentionConfig, ModelConfig, compose_config
from jaxcb.model.config import resolve_llama_config
from jaxcb.model.llama import LayerOps


def backend_classes() -> list[type]:
    """Backend and every subclass of it that jaxcb defines."""
    found, todo = [], [Backend]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("jaxcb."):
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(f) for name, f in vars(LayerOps).items()
            if inspect.isfunction(f) and not name.startswith("_")}


def test_the_protocol_lists_what_the_model_calls():
    assert set(protocol_methods()) == {"self_attention", "add_attention_output", "add_mlp"}
    assert all(isinstance(vars(LayerOps)[name], property) for name in ("cfg", "attention"))


@pytest.mark.parametrize("cls", backend_classes(), ids=lambda cls: cls.__name__)
def test_every_backend_class_has_each_layer_operation_with_the_models_parameters(cls):
    for name, expected in protocol_methods().items():
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} lacks {name}"
        assert list(inspect.signature(method).parameters) == list(expected.parameters), (cls.__name__, name)


@pytest.mark.parametrize("name", ["xla", "cpu"])
def test_each_backend_that_runs_on_cpu_is_a_layer_ops(name):
    arch = resolve_llama_config(compose_config(["model=tiny"]).model)
    model = ModelConfig(name="tiny", init="random", dtype="float32", backend=name, layer_loop="unrolled")
    # The cpu backend's C++ kernels build with the system compiler, which the suite requires (as
    # tests/test_cpu_kernels.py does): a machine where they do not build fails here, not skips.
    backend = select_backend(model, arch, AttentionConfig(impl="xla"), platform="cpu")
    assert backend.name == name
    assert isinstance(backend, LayerOps)
