"""server.log_requests: one INFO line per request as it arrives, named by the id its response carries (so that
a client's X-Request-Id finds it), with its endpoint, model, prompt and sampling parameters, as vLLM's
--enable-log-requests logs them. server.max_log_len cuts the prompt's text (the rest is counted). No jax.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from jaxcb.prompts import prompt_text_and_ids

if TYPE_CHECKING:
    from jaxcb.server.app import ServerState
    from jaxcb.server.requests import PlannedRequest

log = logging.getLogger(__name__)


def shown(text: str, max_len: Optional[int]) -> str:
    """`text` as a log line shows it: its repr, cut after `max_len` characters with the rest counted."""
    if max_len is None or len(text) <= max_len:
        return repr(text)
    return f"{text[:max_len]!r}... ({len(text) - max_len} more characters)"


def log_received(state: "ServerState", response_id: str, endpoint: str, planned: "PlannedRequest") -> None:
    """The request's line, where server.log_requests asks for it."""
    srv = state.cfg.server
    if not srv.log_requests:
        return
    tok = state.client.tokenizer
    prompts = []
    for prompt in planned.prompts:
        text, ids = prompt_text_and_ids(prompt, tok)
        text = text if text is not None else tok.decode(ids, skip_special_tokens=False)
        prompts.append(f"{shown(text, srv.max_log_len)} ({len(ids)} tokens)")
    search = f", beam search {planned.beam}" if planned.beam is not None else ""
    log.info("received %s: %s, model %s, prompt%s %s, params %s%s", response_id, endpoint,
             planned.model or state.model_name, "s" if len(prompts) > 1 else "", "; ".join(prompts), planned.params,
             search)
