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


def log_received(state: "ServerState", response_id: str, endpoint: str, planned: "PlannedRequest",
                 client_id: Optional[str] = None) -> None:
    """The request's line, where server.log_requests asks for it; `client_id`: its X-Request-Id header, named
    where the response's id does not hold it (a /v1/responses id is jaxcb's)."""
    srv = state.cfg.server
    if not srv.log_requests:
        return
    prompts = [_prompt(prompt, state.client.tokenizer, srv.max_log_len) for prompt in planned.prompts]
    search = f", beam search {planned.beam}" if planned.beam is not None else ""
    named = f" (X-Request-Id {client_id!r})" if client_id is not None and not response_id.endswith(f"-{client_id}") \
        else ""
    log.info("received %s%s: %s, model %s, prompt%s %s, params %s%s", response_id, named, endpoint,
             planned.model or state.model_name, "s" if len(prompts) > 1 else "", "; ".join(prompts), planned.params,
             search)


def _prompt(prompt, tokenizer, max_len: Optional[int]) -> str:
    """A prompt as the log shows it: its text, or its ids' decoding; ids the tokenizer cannot decode (the engine
    refuses them next, naming the prompt) as the ids themselves."""
    try:
        text, ids = prompt_text_and_ids(prompt, tokenizer)
        text = text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
    except Exception:  # (ids outside the vocabulary: decoding raises, where the engine's check gives a 400)
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
        return f"token ids {shown(str(ids), max_len)} ({len(ids)} tokens)"
    return f"{shown(text, max_len)} ({len(ids)} tokens)"
