"""Errors a request can meet, split by what the client should do: fix the request, or retry later.

The server maps them to HTTP: InvalidRequestError -> 400, EngineOverloadedError -> 429 with
a Retry-After header.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the command line or a file; the entry points print it as one line, no traceback."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given; the message names the field and the limit.

    `field` is the request field at fault as a path ("temperature", "messages.0.content"), or
    None when no one field is (an empty prompt); the server returns it as the error's `param`
    and a job's error record carries it."""

    retryable = False

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class EngineOverloadedError(RuntimeError):
    """The queue is full now; the same request may succeed after `retry_after_s` seconds."""

    retryable = True

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(f"{message}; retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served until the server restarts."""
