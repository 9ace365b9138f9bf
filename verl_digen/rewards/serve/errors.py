"""The refusal every part of the reward server raises: an HTTP status and a message, answered
as ``{"error": message}`` in the request's protocol (:mod:`verl_digen.rewards.serve.app`)."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with a JSON ``{"error": message}``."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
