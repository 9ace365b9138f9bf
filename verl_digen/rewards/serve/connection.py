"""The reward server's connections (uvicorn's h11 protocol, subclassed): their two budgets, the
request head's deadline, strict ``Content-Length``, and answers in JSON where uvicorn's are plain text."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from verl_digen.rewards.serve.auth import head_authorized

logger = logging.getLogger("verl_digen.rewards.serve")

_MAX_HEAD_BYTES = 64 * 1024


def _raw_json_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def connection_class(server: Any) -> type:
    """uvicorn's h11 protocol for ``server`` (a :class:`~verl_digen.rewards.serve.app.RewardServer`)
    with what uvicorn has no setting for, each answered in JSON:

    * two connection budgets: ``max_unauthenticated_connections`` for connections that have not
      authenticated yet (no complete request head with the right token; with no token
      configured, no complete request head yet) and ``max_connections`` for the others. A new
      connection that would exceed the first closes the *oldest* unauthenticated one with a
      503, so idle or dripping sockets can never starve a client that sends its token: that
      client's head arrives right after its connect. An authenticated connection over the
      second gets the 503 (uvicorn's ``limit_concurrency`` answers in plain text, and counts
      every socket alike);
    * a deadline for the request head (uvicorn waits forever for a dripping head);
    * strict ``Content-Length``: digits only and at most one header (h11 merges identical
      duplicates, RFC 9110 8.6 allows that; behind a proxy it is a request-smuggling vector);
    * its 400 for malformed HTTP in JSON (uvicorn's is plain text)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    pending: dict[Any, None] = {}  # connections that have not authenticated, oldest first
    authenticated: set[Any] = set()

    class RewardProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head = b""
            self._in_head = True
            self._head_timer: asyncio.TimerHandle | None = None
            self._authenticated = False
            pending[self] = None
            if len(pending) > server.max_unauthenticated_connections:
                oldest = next(iter(pending))
                del pending[oldest]
                logger.warning(
                    "closing the oldest of %d connections that have not authenticated (max_unauthenticated_connections)",
                    len(pending) + 1,
                )
                oldest._refuse(
                    503,
                    "Service Unavailable",
                    f"server busy: more than {server.max_unauthenticated_connections} connections have not "
                    "authenticated (--max-unauthenticated-connections); the oldest is closed",
                )
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            marker = self.cycle
            self._head_timer = self.loop.call_later(server.read_timeout_s, self._head_timeout, marker)

        def _head_timeout(self, marker: Any) -> None:
            idle = self.cycle is marker and (self.cycle is None or self.cycle.response_complete)
            if idle and self._in_head and not self.transport.is_closing():
                self._refuse(
                    408, "Request Timeout",
                    f"the request head did not arrive within {server.read_timeout_s:g} s (--read-timeout-s)",
                )

        def _refuse(self, status: int, reason: str, message: str) -> None:
            if not self.transport.is_closing():
                self.transport.write(_raw_json_response(status, reason, message))
                self.transport.close()

        def _authenticate(self, head: bytes) -> bool:
            """Move this connection to the authenticated budget when ``head`` carries the token
            (any head, when the server has none); False when it was refused instead."""
            if self._authenticated or not head_authorized(server.token, head):
                return True
            pending.pop(self, None)
            if len(authenticated) >= server.max_connections:
                logger.warning("refusing a connection: %d authenticated open (max_connections)", len(authenticated))
                self._refuse(
                    503, "Service Unavailable",
                    f"server busy: more than {server.max_connections} authenticated connections (--max-connections)",
                )
                return False
            self._authenticated = True
            authenticated.add(self)
            return True

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            if self._in_head:
                self._head += data
                end = self._head.find(b"\r\n\r\n")
                if end >= 0 or len(self._head) > _MAX_HEAD_BYTES:
                    head = self._head[: end if end >= 0 else _MAX_HEAD_BYTES]
                    problem = _head_problem(head)
                    self._in_head, self._head = False, b""
                    if problem:
                        logger.warning("refusing a request: %s", problem)
                        self._refuse(400, "Bad Request", problem)
                        return
                    if end >= 0 and not self._authenticate(head):
                        return
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._in_head, self._head = True, b""
            if not self.transport.is_closing():
                self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
            pending.pop(self, None)
            authenticated.discard(self)
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self._refuse(400, "Bad Request", f"malformed HTTP request: {msg}")

    return RewardProtocol


def _head_problem(head: bytes) -> str | None:
    """What is wrong with a request head's Content-Length headers, if anything."""
    values = []
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"content-length":
            values.append(value.strip())
    if len(values) > 1:
        return f"{len(values)} Content-Length headers; send exactly one"
    if values and not re.fullmatch(rb"[0-9]{1,19}", values[0]):
        return f"invalid Content-Length {values[0].decode('latin-1')!r}: digits only"
    return None
