"""HTTP transport of the remote rewards (``http`` and ``vlm_judge``), on httpx.

One :class:`Endpoint` POSTs bodies with:

* **a total deadline per attempt**: ``timeout_s`` bounds the whole attempt (connect, send,
  wait, and reading the entire answer), not each socket read: a server that drips its answer
  a byte at a time is cut off at the deadline. httpx's own timeouts are per operation, so the
  attempt runs under :func:`asyncio.wait_for`, which cancels it wherever it is;
* **no redirects**: a 3xx answer is an error naming the target (never retried, never
  followed), so a bearer token or API key can never reach another host;
* **a response size cap**: ``max_response_bytes``, checked against ``Content-Length`` before
  reading and while streaming (compressed answers are not requested: ``Accept-Encoding:
  identity``);
* **retries with exponential backoff** for connection errors, timeouts, HTTP 5xx and 429
  (``backoff_s * 2**k`` before retry ``k + 1``, ``max_retries`` attempts in all). httpx's
  transport retries cover connection failures only, not 5xx/429 answers, so this policy is the
  small loop in :meth:`Endpoint.post_many`.

Every failure raises :class:`RewardServerError` naming the endpoint. The calls are async
(``httpx.AsyncClient``) so that many requests can be in flight at once (``concurrency``);
:func:`run_sync` runs them from the synchronous reward interface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import httpx

__all__ = [
    "Endpoint",
    "RewardServerError",
    "RetryableError",
    "check_retry_settings",
    "check_tcp_reachable",
    "run_sync",
    "snippet",
]

_T = TypeVar("_T")
_RETRYABLE_STATUS = {429}  # plus every 5xx


class RewardServerError(RuntimeError):
    """The reward server could not be reached or gave an unusable answer."""


class RetryableError(Exception):
    """An attempt failed in a way that is worth retrying (connection error, timeout, 5xx, 429).

    ``answered`` is True when the server did answer (with a retryable HTTP status).
    """

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


def check_retry_settings(
    reward: str, *, timeout_s: float, max_retries: int, backoff_s: float, max_response_mb: float = 1.0
) -> None:
    """Raise ``ValueError("reward '<reward>': ...")`` for a bad timeout, retry count, backoff or cap."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"reward '{reward}': timeout_s must be a finite number > 0, got {timeout_s!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 1:
        raise ValueError(f"reward '{reward}': max_retries must be an int >= 1, got {max_retries!r}")
    if isinstance(backoff_s, bool) or not isinstance(backoff_s, (int, float)) or not 0 <= backoff_s < float("inf"):
        raise ValueError(f"reward '{reward}': backoff_s must be a finite number >= 0, got {backoff_s!r}")
    if isinstance(max_response_mb, bool) or not isinstance(max_response_mb, (int, float)) or not 0 < max_response_mb < float("inf"):
        raise ValueError(f"reward '{reward}': max_response_mb must be a finite number > 0, got {max_response_mb!r}")


def snippet(payload: bytes, limit: int = 200) -> str:
    """A response body for error messages: its start; a pickled body (the flow_grpo / veRL-Omni
    servers answer a 500 with ``pickle.dumps({"error": traceback})``) unpickled safely, its
    ``error`` text with the end kept (where a traceback names the exception), up to 4 x ``limit``."""
    if payload[:1] == b"\x80":  # a pickle (protocol 2+)
        from verl_digen.rewards.safe_pickle import UnsafePickleError, safe_loads

        try:
            value = safe_loads(payload)
        except UnsafePickleError:
            value = None
        if value is not None:
            text = str(value["error"] if isinstance(value, dict) and "error" in value else value).strip()
            return text if len(text) <= 4 * limit else "..." + text[-4 * limit:]
    text = payload[: limit * 4].decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


def run_sync(make: Callable[[], Awaitable[_T]]) -> _T:
    """Run the coroutine ``make()`` to completion from synchronous code.

    In a thread without an event loop (a Ray worker, a script) this is :func:`asyncio.run`;
    inside a running loop (a notebook) the coroutine runs on a helper thread's own loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())  # type: ignore[arg-type]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-http") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()  # type: ignore[arg-type]


class Endpoint:
    """POSTs to one URL with the bounds and retry policy in the module docstring.

    Args:
        url: the endpoint.
        name: how errors name it, e.g. ``"reward server http://host:8000/score"``.
        token: sent as ``Authorization: Bearer <token>`` when given.
        timeout_s: total deadline of one attempt, seconds.
        max_retries: attempts per request in total, the first one included.
        backoff_s: sleep before the first retry, doubled for each further one.
        max_response_bytes: largest answer accepted.
        concurrency: most requests in flight at once in :meth:`post_many`.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str,
        token: str | None = None,
        timeout_s: float,
        max_retries: int,
        backoff_s: float,
        max_response_bytes: int,
        concurrency: int = 1,
    ) -> None:
        self.url = url
        self.name = name
        self.token = token or None
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_response_bytes = int(max_response_bytes)
        self.concurrency = int(concurrency)

    def headers(self, content_type: str) -> dict[str, str]:
        headers = {"Content-Type": content_type, "Accept-Encoding": "identity"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def post_many(self, bodies: Sequence[bytes], content_type: str) -> list[bytes]:
        """POST every body (up to ``concurrency`` at once, each with retries); the 2xx answers in
        order. The first failure (in order) is raised once every request has ended."""
        return run_sync(lambda: self._post_many(list(bodies), content_type))

    def post(self, body: bytes, content_type: str) -> bytes:
        return self.post_many([body], content_type)[0]

    async def _post_many(self, bodies: list[bytes], content_type: str) -> list[bytes]:
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        # follow_redirects=False is httpx's default; said here because it is a security property.
        async with httpx.AsyncClient(follow_redirects=False, timeout=self.timeout_s, limits=limits) as client:
            gate = asyncio.Semaphore(self.concurrency)
            headers = self.headers(content_type)

            async def one(body: bytes) -> bytes:
                async with gate:
                    return await self._with_retries(client, body, headers)

            tasks = [asyncio.ensure_future(one(body)) for body in bodies]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in tasks:  # one failure stops the batch: cancel what has not finished
                    if not task.done():
                        task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return [task.result() for task in tasks]

    async def _with_retries(self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str]) -> bytes:
        last: RetryableError | None = None
        for index in range(1, self.max_retries + 1):
            if index > 1:
                await asyncio.sleep(self.backoff_s * 2 ** (index - 2))
            try:
                return await asyncio.wait_for(self._attempt(client, body, headers), self.timeout_s)
            except asyncio.TimeoutError:
                last = RetryableError(
                    f"timed out: no complete answer within timeout_s={self.timeout_s:g} s (total deadline per attempt)"
                )
            except RetryableError as exc:
                last = exc
        assert last is not None
        outcome = "failed" if last.answered else "unreachable"
        raise RewardServerError(f"{self.name} {outcome} after {self.max_retries} attempts: {last}")

    async def _attempt(self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str]) -> bytes:
        try:
            async with client.stream("POST", self.url, content=body, headers=headers) as response:
                status = response.status_code
                if 300 <= status < 400:
                    target = response.headers.get("location", "(no Location)")
                    raise RewardServerError(
                        f"{self.name} answered HTTP {status} redirecting to {target!r}; redirects are not followed "
                        "(the request may carry credentials): point the URL at the final address"
                    )
                payload = await self._read_capped(response)
        except httpx.TimeoutException as exc:
            raise RetryableError(f"timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:  # refused, reset, truncated answer, protocol error
            raise RetryableError(_describe(exc)) from exc
        if status >= 400:
            detail = snippet(payload)
            message = f"HTTP {status} {response.reason_phrase}" + (f": {detail}" if detail else "")
            if status >= 500 or status in _RETRYABLE_STATUS:
                raise RetryableError(message, answered=True)
            raise RewardServerError(f"{self.name} rejected the request: {message}")
        return payload

    async def _read_capped(self, response: httpx.Response) -> bytes:
        cap = self.max_response_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise RewardServerError(
                f"{self.name} answered with {int(declared)} bytes, above the limit of {cap} bytes (max_response_mb)"
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > cap:
                raise RewardServerError(
                    f"{self.name} answered with more than {cap} bytes, above the limit (max_response_mb); "
                    "stopped reading"
                )
            chunks.append(chunk)
        return b"".join(chunks)


def _describe(exc: BaseException) -> str:
    """An httpx error with its root OS error (httpx says "All connection attempts failed"; the
    OS error says "Connection refused")."""
    import os

    text = str(exc) or type(exc).__name__
    cause, depth = exc.__cause__ or exc.__context__, 0
    while cause is not None and depth < 5:
        if isinstance(cause, OSError) and cause.errno:
            reason = os.strerror(cause.errno)
            return f"{text} ({reason}: {cause})" if reason not in text else text
        cause, depth = cause.__cause__ or cause.__context__, depth + 1
    return text


def check_tcp_reachable(
    parsed: urllib.parse.SplitResult, name: str, *, timeout_s: float, max_retries: int, backoff_s: float
) -> None:
    """Open (and close) a TCP connection to the host of the URL ``parsed``, with the retry policy
    of :class:`Endpoint`; raises ``RewardServerError("<name> unreachable after ...")``."""
    import time

    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    last = ""
    for index in range(1, max_retries + 1):
        if index > 1:
            time.sleep(backoff_s * 2 ** (index - 2))
        try:
            with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
                return
        except OSError as exc:
            last = str(exc)
    raise RewardServerError(f"{name} unreachable after {max_retries} attempts: {last}")


def parse_json_answer(payload: bytes, name: str) -> Any:
    """``json.loads(payload)``; a malformed-response error naming the body's start if it is not JSON."""
    import json

    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise malformed_response(name, f"not JSON ({exc}); body starts with {snippet(payload)!r}") from None


def malformed_response(name: str, problem: str) -> RewardServerError:
    return RewardServerError(f"{name} returned a malformed response: {problem}")
