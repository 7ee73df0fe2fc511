"""Grammar compilation with llguidance: a `StructuredOutputs` spec becomes a matcher factory.

`GrammarCompiler.compile(spec)` turns a spec into a `CompiledGrammar` (cached by spec; a
second request with the same schema costs a dict lookup) within `max_compile_s`, else the
request is refused with a 400 naming the spec's field. The server calls it off the engine's
thread before queueing (`asyncio.to_thread`), so a slow schema never stalls a step; offline
use compiles in `Engine.add_request` and hits the same cache.

Each sequence gets its own matcher (`CompiledGrammar.matcher()`, a copy of a compiled one);
the matcher says which tokens may come next (a bitmask row, EOS only where the grammar
accepts) and consumes every accepted token.

llguidance (one 3 MB wheel, no dependencies) is imported only here and only when a grammar is
first compiled, so an engine that never sees one never loads it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

from jaxcb.structured.spec import StructuredOutputs, StructuredOutputsError

log = logging.getLogger(__name__)

# JSON as jaxcb writes it: single separators, no free whitespace (llguidance's JSON options).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask (bit i of word i // 32: token i may come next)."""
    return (vocab_size + 31) // 32


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of the engine's tokenizer: the HF tokenizers JSON when there is one
    (HF directories and GGUF vocabularies), else the byte-level vocabulary."""
    import llguidance

    eos = list(eos_token_ids) or None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    tokens = getattr(tokenizer, "token_bytes", None)
    if tokens is None:
        raise TypeError(f"{type(tokenizer).__name__} gives no vocabulary for structured outputs")
    specials = list(getattr(tokenizer, "special_token_ids", []))

    class _Vocabulary:  # llguidance.TokenizerWrapper's duck type
        eos_token_id = eos[0] if eos else None
        bos_token_id = getattr(tokenizer, "bos_token_id", None)
        special_token_ids = specials

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text):
            return tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text,
                                    add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary()), n_vocab=vocab_size, eos_token=eos)


def _grammar_text(spec: StructuredOutputs) -> str:
    import llguidance

    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=_JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.text)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    try:  # "grammar": EBNF in llama.cpp's GBNF or in Lark
        return llguidance.grammar_from("grammar", spec.text)
    except ValueError as e:
        raise StructuredOutputsError(f"{spec.field}: the grammar is neither GBNF nor Lark: {e}", spec.field) from None


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any):
        self._m = matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (i32[bitmask_words(V)], C-contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token_id: int) -> bool:
        """Advance past a sampled token; False (and an error state) if the grammar did not allow it."""
        return bool(self._m.consume_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS could follow)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> Optional[str]:
        return self._m.get_error() if self._m.is_error() else None


class CompiledGrammar:
    def __init__(self, spec: StructuredOutputs, template: Any):
        self.spec = spec
        self._template = template  # a fresh matcher; every sequence gets a copy

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles specs for one tokenizer, each at most once (LRU of `cache_size`), in at most `max_compile_s`."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], *, max_compile_s: float,
                 cache_size: int = 128):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.max_compile_s = max_compile_s
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tok = None
        # Compiles run here, so that one past its time limit can be given up on (llguidance releases
        # the GIL while it compiles; its own limits bound the work left behind).
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.num_compiled: dict[tuple[str, str], int] = {}  # compiles per (kind, text): 1 while it stays cached

    def _tokenizer(self):
        with self._lock:
            if self._ll_tok is None:
                self._ll_tok = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._ll_tok

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        key = (spec.kind, spec.text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        future = self._pool.submit(self._compile, spec)
        try:
            compiled = future.result(timeout=self.max_compile_s)
        except concurrent.futures.TimeoutError:
            raise StructuredOutputsError(
                f"{spec.field}: compiling it took longer than engine.max_grammar_compile_s={self.max_compile_s:g} s; "
                "simplify the schema or grammar", spec.field) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        import llguidance

        try:
            grammar = _grammar_text(spec)
        except ValueError as e:  # not JSON, an unknown format
            raise StructuredOutputsError(f"{spec.field}: {e}", spec.field) from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            # A grammar jaxcb built from the tools' schemas: its text is not the client's, only the reason is
            shown = 1 if spec.field == "tools" else 3
            raise StructuredOutputsError(f"{spec.field} does not compile: {_first_line(matcher.get_error(), shown)}",
                                         spec.field)
        key = (spec.kind, spec.text)
        self.num_compiled[key] = self.num_compiled.get(key, 0) + 1
        return CompiledGrammar(spec, matcher)


def _first_line(error: str, num_lines: int = 3) -> str:
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    return " ".join(lines[:num_lines])[:500] if lines else "unknown error"


def dumps_compact(value: Any) -> str:
    """JSON as the grammars write it (for tests and tool-call arguments)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
