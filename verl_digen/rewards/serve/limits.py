"""The reward server's bounds on what requests may hold: the defaults shared by
:class:`~verl_digen.rewards.serve.app.RewardServer` and the CLI, the memory they allow
(:func:`memory_budget_bytes`), the budgets that concurrent requests wait for (:class:`Budget`), the
checks of the options, and the per-request size and time limits (``Content-Length`` against
``max_body_mb``, the body's ``read_timeout_s``). The connection budgets and the request head's
deadline are in :mod:`verl_digen.rewards.serve.connection`."""

from __future__ import annotations

import asyncio
from typing import Any

from verl_digen.rewards.serve.errors import RequestError

MIB = 1024 * 1024

# Defaults, shared by RewardServer and the CLI. With them the server's decode and parse memory
# stays under 1 GiB above idle, whatever the clients send (docs/reward_server.md, "Memory").
DEFAULT_MAX_BODY_MB = 64.0
DEFAULT_MAX_BODY_TOTAL_MB = 64.0
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_REQUEST_PIXELS = 64 * MIB
DEFAULT_MAX_DECODE_PIXELS = 96 * MIB
DEFAULT_SCORE_CHUNK_PIXELS = 16 * MIB
DEFAULT_DECODE_WAIT_S = 30.0
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS = 64
DEFAULT_DECODE_THREADS = 4


def memory_budget_bytes(
    *,
    max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    decode_threads: int = DEFAULT_DECODE_THREADS,
    score_chunk_pixels: int = DEFAULT_SCORE_CHUNK_PIXELS,
    max_body_total_mb: float = DEFAULT_MAX_BODY_TOTAL_MB,
) -> int:
    """The most the server's request handling may hold above idle, all concurrent requests
    together (the reward's own working memory not included), in bytes:

    * 3 B per pixel of the uint8 images of every request admitted to the decode budget;
    * 4 B per pixel of the images PIL is decoding (one per decode thread, each within the
      decode budget);
    * 12 B per pixel of the one float32 chunk being scored (conversions run under the reward lock);
    * 3 B per byte of the bodies in the body budget (the body, its text and the parsed strings).
    """
    return (
        3 * max_decode_pixels
        + 4 * min(max_decode_pixels, decode_threads * max_image_pixels)
        + 12 * score_chunk_pixels
        + 3 * int(max_body_total_mb * MIB)
    )


class Budget:
    """An amount (pixels being decoded or scored, bytes of request bodies) held across all
    requests, at most ``total`` at once.

    A request waits (asynchronously) until its amount fits, for at most ``wait_s``; then
    :class:`RequestError` 503 naming ``option``. Used on the server's event loop only;
    :meth:`release` is synchronous, so it is safe in a ``finally`` of a cancelled task."""

    def __init__(self, total: int, wait_s: float, *, what: str, unit: str, option: str) -> None:
        self.total = total
        self.wait_s = wait_s
        self.what = what
        self.unit = unit
        self.option = option
        self.used = 0
        self._freed: asyncio.Event | None = None

    async def acquire(self, amount: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while self.used + amount > self.total:
            remaining = deadline - loop.time()
            if self._freed is None:
                self._freed = asyncio.Event()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(self._freed.wait(), remaining)
            except asyncio.TimeoutError:
                raise RequestError(
                    503,
                    f"server busy: the {self.what} of {self.total} {self.unit} stayed full for {self.wait_s:g} s; "
                    f"retry later (the server's {self.option} sets it, --decode-wait-s the wait)",
                    headers={"Retry-After": "1"},
                ) from None
        self.used += amount

    def release(self, amount: int) -> None:
        self.used -= amount
        if amount and self._freed is not None:
            self._freed.set()  # wakes every waiter; each re-checks whether it fits now
            self._freed = None


def check_options(
    *,
    max_body_mb: Any,
    max_body_total_mb: Any,
    read_timeout_s: Any,
    decode_wait_s: Any,
    max_batch: Any,
    max_image_pixels: Any,
    max_request_pixels: Any,
    max_decode_pixels: Any,
    score_chunk_pixels: Any,
    max_connections: Any,
    max_unauthenticated_connections: Any,
    decode_threads: Any,
) -> None:
    """Raise ValueError for a server option out of range, or for two that contradict each other."""
    for key, value in (("max_body_mb", max_body_mb), ("max_body_total_mb", max_body_total_mb),
                       ("read_timeout_s", read_timeout_s), ("decode_wait_s", decode_wait_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
    for key, value in (("max_batch", max_batch), ("max_image_pixels", max_image_pixels),
                       ("max_request_pixels", max_request_pixels), ("max_decode_pixels", max_decode_pixels),
                       ("score_chunk_pixels", score_chunk_pixels), ("max_connections", max_connections),
                       ("max_unauthenticated_connections", max_unauthenticated_connections),
                       ("decode_threads", decode_threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an int >= 1, got {value!r}")
    if max_request_pixels > max_decode_pixels:
        raise ValueError(
            f"max_request_pixels={max_request_pixels} exceeds max_decode_pixels={max_decode_pixels}: "
            "such a request could never be decoded"
        )
    if max_body_mb > max_body_total_mb:
        raise ValueError(
            f"max_body_mb={max_body_mb} exceeds max_body_total_mb={max_body_total_mb}: "
            "such a body could never be read"
        )


def content_length(headers: Any, max_body_bytes: int) -> int:
    """A request's body length from its headers: 411 without one (or chunked), 400 when it is not
    digits, 413 above ``max_body_bytes`` (answered before the body is read)."""
    if headers.get("transfer-encoding"):
        raise RequestError(411, "chunked request bodies are not supported; send a Content-Length")
    value = headers.get("content-length")
    if value is None:
        raise RequestError(411, "missing Content-Length header")
    if not value.isascii() or not value.isdigit():  # also checked on the raw head
        raise RequestError(400, f"invalid Content-Length {value!r}")
    length = int(value)
    if length > max_body_bytes:
        raise RequestError(
            413,
            f"request body of {length} bytes exceeds the server limit of {max_body_bytes} bytes "
            "(--max-body-mb); send smaller batches",
        )
    return length


async def read_body(request: Any, length: int, read_timeout_s: float) -> bytes:
    """A request's body of ``length`` bytes, all of it within ``read_timeout_s`` (else 408)."""
    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > length:  # h11 frames by Content-Length; this is a safety net
                raise RequestError(400, f"request body is longer than its Content-Length {length}")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        body = await asyncio.wait_for(read(), read_timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(
            408, f"the request body did not arrive within {read_timeout_s:g} s (--read-timeout-s)"
        ) from None
    if len(body) != length:
        raise RequestError(400, f"request body ended after {len(body)} of {length} bytes")
    return body
