"""jaxcb: a continuous-batching LLM inference engine in JAX.

    from jaxcb import LLM, SamplingParams
    from jaxcb.config import compose_config
    outputs = LLM(compose_config(["model=tiny"])).generate(["Hello"], SamplingParams(max_tokens=16))

The names load on first use, so that `import jaxcb.config` (host-side modules) does not import jax.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "Engine", "SamplingParams", "BeamSearchParams"]


def __getattr__(name: str):
    if name in ("LLM", "Engine"):
        from jaxcb import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from jaxcb.sampling_params import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":  # LLM.beam_search's
        from jaxcb.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module 'jaxcb' has no attribute {name!r}")
