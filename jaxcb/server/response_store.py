"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory, for the server's
lifetime, at most `server.responses_store_size` of them (the least recently stored dropped first).

Each holds the response object a client got and the conversation it ended (chat messages: the
input so far and the reply, without the instructions, which OpenAI does not carry over). Past
the bound, or after a restart, an id is a 404 that says so. No jax.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from jaxcb.server.protocol import APIError


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as sent
    conversation: tuple[dict[str, Any], ...]  # chat messages up to and including the reply


class ResponseStore:
    def __init__(self, max_size: int):
        self.max_size = max_size
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep `response`; False when the store keeps none (server.responses_store_size=0)."""
        if self.max_size == 0:
            return False
        self._stored[response["id"]] = StoredResponse(response, tuple(conversation))
        while len(self._stored) > self.max_size:
            self._stored.popitem(last=False)
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
        return self.get(response_id, "previous_response_id").conversation

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._stored[response_id]
