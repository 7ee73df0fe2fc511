"""Incremental detokenization and stop strings for one sequence.

Each token decodes a short window of recent ids, never the whole sequence (the prefix-offset /
read-offset scheme of vLLM and of HF `tokenizers`' DecodeStream): the window starts at the ids
shown before the last new text, so a decoder that treats a first token apart (a leading space
dropped) or joins bytes across tokens reads the new ids in context, and its text past what those
ids showed is the new text. The tokenizer's own stream (`Tokenizer.decode_stream`: one call a
token, in Rust for HF tokenizers) does it where it has one; windows decoded here do it otherwise.

Text grows only by whole characters: a token that ends inside a multi-byte character (the
window's text ends in U+FFFD) is held back until the character completes. Stop strings are
searched in the text; the text is cut where the stop string starts (or, with
`include_stop_str_in_output`, where it ends), and `stream_text` holds back any tail that could
still become the start of one.
"""

from __future__ import annotations

import logging
from typing import Optional

from jaxcb.tokenizer import REPLACEMENT, Tokenizer

log = logging.getLogger(__name__)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._stream = tokenizer.decode_stream(skip_special_tokens)  # None: windows decoded here
        # The window: token_ids[_prefix_offset:]; its ids before _read_offset have shown their text.
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_checked = 0  # text before this offset holds no stop string
        self._max_stop_len = max((len(x) for x in stop), default=0)
        self.stopped = False

    def add_token(self, token_id: int) -> Optional[str]:
        """Append a token; return the stop string it completed, if any."""
        self.token_ids.append(token_id)
        new_text = self._step_stream(token_id) if self._stream is not None else self._step_window()
        if new_text:
            self.text += new_text
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._check_stop() if self.stop else None

    def _step_stream(self, token_id: int) -> Optional[str]:
        try:
            return self._stream(token_id)
        except Exception as e:  # noqa: BLE001 -- DecodeStream's "Invalid prefix encountered" (vLLM #17448)
            # A decoder whose text for the window does not start with its text for the ids shown:
            # windows decoded here from now on, as this sequence's stream left them.
            log.warning("the tokenizer's decode stream failed (%s); this sequence decodes windows of ids instead", e)
            self._stream = None
            return self._step_window()

    def _step_window(self) -> Optional[str]:
        """The window's new text, or None while it ends inside a character."""
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT):
            return window[len(prefix) :]
        return None

    def add_stop_token(self, token_id: int) -> None:
        """Append the EOS or stop token that ends the sequence: its id counts, its text never shows
        (with skip_special_tokens=False it would: `</s>`)."""
        self.finish()
        self.token_ids.append(token_id)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._stream = None  # nothing follows

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def finish(self) -> None:
        """Flush what was held back (a character that never completed shows as U+FFFD)."""
        if not self.stopped and self._read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            window = self._decode(self.token_ids[self._prefix_offset :])
            self.text += window[len(prefix) :]
            self._read_offset = len(self.token_ids)
            self._check_stop()

    def _check_stop(self) -> Optional[str]:
        if self.stopped:
            return None
        # Only the new text and the tail before it that a stop string could straddle: the search
        # costs the same at every token, however long the text.
        start = max(0, self._num_checked - self._max_stop_len + 1)
        self._num_checked = len(self.text)
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits, key=lambda hit: (hit[0], self.stop.index(hit[1])))  # ties: the first listed
        self.text = self.text[: index + len(stop) if self.include_stop_str else index]
        self.stopped = True
        return stop

    @property
    def stream_text(self) -> str:
        """The text that can be shown now: minus any tail that may yet begin a stop string."""
        return self.text[: self.stream_length]

    @property
    def stream_length(self) -> int:
        """len(stream_text), without copying the text."""
        if self.stopped or not self.stop or self.include_stop_str:  # a stop string in the text stays: no hold
            return len(self.text)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return len(self.text) - hold
