"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory, for the server's
lifetime, at most `server.responses_store_size` of them (the least recently stored dropped first).

Each holds the response object a client got and the conversation it ended (chat messages: the
input so far and the reply, without the instructions, which OpenAI does not carry over). Past
the bound, or after a restart, an id is a 404 that says so. No jax.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from jaxcb.server.protocol import APIError


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as sent (a background one: as it stands)
    conversation: Optional[tuple[dict[str, Any], ...]]  # chat messages up to and including the reply; None: none yet


class ResponseStore:
    def __init__(self, max_size: int):
        self.max_size = max_size
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: Optional[list[dict[str, Any]]]) -> bool:
        """Keep `response` (in place of what its id held); False when the store keeps none
        (server.responses_store_size=0). `conversation` None: a background response not finished, which
        previous_response_id cannot continue yet."""
        if self.max_size == 0:
            return False
        self._stored[response["id"]] = StoredResponse(response, None if conversation is None else tuple(conversation))
        # the least recently stored go first, but never a background response still running (the server caps
        # those at max_size): only the store can find, poll or cancel it
        # (and never the one just stored: with every other one running, the store holds one more for a while)
        excess, victims = len(self._stored) - self.max_size, []
        for response_id, kept in self._stored.items() if excess > 0 else ():
            if len(victims) == excess:
                break
            if response_id != response["id"] and not _running(kept):
                victims.append(response_id)
        for response_id in victims:
            del self._stored[response_id]
        return True

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self._stored.get(response_id)
        if stored is None:
            raise APIError(404, f"{param} {response_id!r} is not stored here: this server keeps the last "
                                f"server.responses_store_size={self.max_size} responses stored since it started "
                                "(store: true); send the conversation as input instead", param=param,
                           type="not_found_error")
        return stored

    def history(self, response_id: str) -> tuple[dict[str, Any], ...]:
        """The conversation that `previous_response_id` continues."""
        stored = self.get(response_id, "previous_response_id")
        if stored.conversation is None:
            status = stored.response["status"]
            if status in ("queued", "in_progress"):
                raise APIError(400, f"previous_response_id {response_id!r} is a background response still {status}: "
                                    "continue it once it has completed (GET /v1/responses/{id} says when)",
                               param="previous_response_id")
            raise APIError(400, f"previous_response_id {response_id!r} ended {status}, with no reply to continue; "
                                "send the conversation as input instead", param="previous_response_id")
        return stored.conversation

    def contains(self, response_id: str) -> bool:
        return response_id in self._stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._stored[response_id]


def _running(stored: StoredResponse) -> bool:
    return stored.response.get("status") in ("queued", "in_progress")
