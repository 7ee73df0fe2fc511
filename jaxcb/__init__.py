"""jaxcb: a continuous-batching LLM inference engine in JAX."""

__version__ = "0.1.0"
