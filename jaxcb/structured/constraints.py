"""One sequence's token constraints: which tokens may come next, as one bitmask row.

Three sources share the one bitmask path of the step (DESIGN.md "Sampling and structured
outputs"): a grammar matcher (structured outputs, enforced tool calls), `allowed_token_ids`
(a fixed set) and `bad_words` (a word's last token is banned where the output so far ends
with the word's other tokens, as vLLM does). `fill` ANDs them into the row the runner sends;
`accept` advances them past each generated token (the output processor calls it).

A grammar may hold only the answer after the model's reasoning (`ReasoningGate`, set by the
server's reasoning parser when `</think>` is one token): until that token is generated the grammar
neither masks nor advances, so the reasoning runs free and may end the sequence (EOS) as an
unconstrained reply could. A reply that may open its reasoning (Qwen3 without `<think>` in the
prompt) gets the grammar's first tokens plus `<think>` at its first step.

A constraint that depends on the tokens so far (a grammar, bad words) needs the previous
token before its next mask exists: under async scheduling such a sequence sits out the step
dispatched while its token is in flight (`depends_on_last_token`). No jax here.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jaxcb.structured.grammar import GrammarMatcher, bitmask_words
from jaxcb.structured.spec import ReasoningGate

# Where a gated grammar stands: in the reasoning (free), at the first token (the answer, or <think>), in the answer.
_REASONING, _FIRST, _ANSWER = "reasoning", "first", "answer"


def ids_bitmask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """i32[bitmask_words(V)] with the bits of `token_ids` set."""
    bits = np.zeros(bitmask_words(vocab_size) * 32, np.uint8)
    bits[np.asarray(list(token_ids), np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def clear_tokens(words: np.ndarray, token_ids: Sequence[int]) -> None:
    """Clear the bits of `token_ids` in a bitmask row viewed as u32 words (u32[bitmask_words(V)])."""
    for t in token_ids:
        words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


class TokenConstraint:
    def __init__(self, vocab_size: int, *, grammar: Optional[GrammarMatcher] = None,
                 allowed_token_ids: Optional[Sequence[int]] = None,
                 bad_words_ids: Sequence[tuple[int, ...]] = (), after_reasoning: Optional[ReasoningGate] = None):
        self.vocab_size = vocab_size
        self.grammar = grammar
        self._gate = after_reasoning if grammar is not None else None
        self._phase = _ANSWER
        if self._gate is not None:
            self._phase = _REASONING if self._gate.inside else _FIRST if self._gate.open_token_id is not None else _ANSWER
        self._allowed = ids_bitmask(allowed_token_ids, vocab_size) if allowed_token_ids else None
        self._banned_always = [w[0] for w in bad_words_ids if len(w) == 1]
        self._banned_after = [w for w in bad_words_ids if len(w) > 1]
        self._recent: list[int] = []  # the last tokens generated, as many as the longest bad word needs
        self._keep = max((len(w) - 1 for w in self._banned_after), default=0)
        self._scratch = np.empty(bitmask_words(vocab_size), np.int32)
        # The last `fill` left no token allowed: what the step draws from that row is not the model's
        # (the output processor ends the sequence instead of emitting it).
        self.dead_end = False
        self.failed = False  # `fill` raised (the runner logged it): the sequence ends as at a dead end

    @property
    def depends_on_last_token(self) -> bool:
        return self.grammar is not None or bool(self._banned_after)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but EOS may follow, so the sequence stops here."""
        return self.grammar is not None and self._phase != _REASONING and self.grammar.is_terminated

    @property
    def in_reasoning(self) -> bool:
        """The reply is still in its reasoning, which the grammar does not hold."""
        return self._phase == _REASONING

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (i32[bitmask_words(V)])."""
        if self.grammar is not None and self._phase != _REASONING:
            self.grammar.fill_bitmask(row)
            if self._phase == _FIRST:
                t = self._gate.open_token_id
                row.view(np.uint32)[t >> 5] |= np.uint32(1 << (t & 31))
            if self._allowed is not None:
                row &= self._allowed
        elif self._allowed is not None:
            row[:] = self._allowed
        else:
            row[:] = -1
        banned = list(self._banned_always)
        for word in self._banned_after:
            prefix = list(word[:-1])
            if self._recent[len(self._recent) - len(prefix):] == prefix:
                banned.append(word[-1])
        words = row.view(np.uint32)
        clear_tokens(words, banned)
        self.dead_end = not words.any()

    def accept(self, token_id: int) -> Optional[str]:
        """Advance past a generated token; an error message if the grammar did not allow it."""
        if self._keep:
            self._recent = (self._recent + [token_id])[-self._keep:]
        if self._phase == _REASONING:
            if token_id == self._gate.end_token_id:
                self._phase = _ANSWER
            return None
        if self._phase == _FIRST:
            if token_id == self._gate.open_token_id:
                self._phase = _REASONING
                return None
            self._phase = _ANSWER
        if self.grammar is not None and not self.grammar.consume(token_id):
            return self.grammar.error or f"token {token_id} is not allowed by the grammar"
        return None
