"""Structured outputs and token constraints: specs from requests, grammars (llguidance, imported lazily),
and each sequence's TokenConstraint that fills its row of the step's token bitmask. No jax."""

from jaxcb.structured.constraints import TokenConstraint, ids_bitmask
from jaxcb.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher, bitmask_words
from jaxcb.structured.spec import StructuredOutputs, StructuredOutputsError, from_response_format, from_structured_outputs

__all__ = [
    "CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "StructuredOutputs", "StructuredOutputsError",
    "TokenConstraint", "bitmask_words", "from_response_format", "from_structured_outputs", "ids_bitmask",
]
