"""The reward server: its FastAPI app (every path and method through one handler, errors as
``{"error": ...}`` in the request's protocol) and :class:`RewardServer`, which binds, reads, decodes
and scores within its limits, and runs uvicorn in a thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from verl_digen.rewards.base import RewardFn, build_reward
from verl_digen.rewards.safe_pickle import safe_dumps
from verl_digen.rewards.serve.auth import check_auth, warn_if_open
from verl_digen.rewards.serve.connection import connection_class
from verl_digen.rewards.serve.errors import RequestError
from verl_digen.rewards.serve.limits import (
    DEFAULT_DECODE_THREADS,
    DEFAULT_DECODE_WAIT_S,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_BODY_TOTAL_MB,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_DECODE_PIXELS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_REQUEST_PIXELS,
    DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_SCORE_CHUNK_PIXELS,
    MIB,
    Budget,
    check_options,
    content_length,
    memory_budget_bytes,
    read_body,
)
from verl_digen.rewards.serve.protocol import HEALTH_PATH, SCORE_PATHS, parse_score_request, protocol_of
from verl_digen.rewards.serve.scoring import call_reward, decode_and_score

logger = logging.getLogger("verl_digen.rewards.serve")


def _json_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _error(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """``{"error": message}``, pickled for a pickle request (flow_grpo's and veRL-Omni's clients
    unpickle every answer and read its ``error``), JSON otherwise."""
    if getattr(request.state, "protocol", None) == "pickle":
        return Response(safe_dumps({"error": message}), status_code=status, headers=headers,
                        media_type="application/octet-stream")
    return _json_error(status, message, headers)


def _build_app(server: RewardServer) -> FastAPI:
    app = FastAPI(title="verl-digen reward server", docs_url=None, redoc_url=None, openapi_url=None)
    every_method = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"]

    @app.api_route("/{path:path}", methods=every_method)
    async def handle(request: Request) -> Response:
        try:
            return await server._handle(request)
        except RequestError as exc:
            level = logging.ERROR if exc.status >= 500 else logging.WARNING
            logger.log(level, "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
            return _error(request, exc.status, exc.message, exc.headers)
        except Exception as exc:  # a bug here must not kill the server; report it
            logger.exception("unexpected error while handling %s %s", request.method, request.url.path)
            return _error(request, 500, f"internal server error: {type(exc).__name__}: {exc}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - safety net
        return _json_error(500, f"internal server error: {type(exc).__name__}")

    return app


class RewardServer:
    """An HTTP server for one reward, usable in-process or from the CLI.

    ::

        with RewardServer("brightness", port=0) as server:   # port 0: any free port
            reward = HttpReward(server.url + "/score")

    Args:
        reward: a :class:`RewardFn` instance or a registered reward name.
        reward_kwargs: keyword arguments for :func:`build_reward` when ``reward`` is a name.
        host: interface to bind (loopback by default).
        port: TCP port; 0 picks a free one (see :attr:`port` after construction).
        token: bearer token required on scoring requests; ``None`` or ``""``: no auth.
        max_body_mb: largest accepted request body, MiB (default 64).
        max_body_total_mb: most request-body bytes held (read, parsed, their encoded images
            until scored) across concurrent requests, MiB; a request waits for room up to
            ``decode_wait_s``, then gets a 503 (default 64).
        max_batch: most samples per request (default 256).
        max_image_pixels: largest accepted image or frame, width * height (default 4096 * 4096).
        max_request_pixels: most pixels (all images, all frames) one request may decode
            (default 64 Mi: 64 images of 1024x1024).
        max_decode_pixels: most pixels being decoded or scored across concurrent requests
            (3 bytes each, uint8 RGB); a request waits for room up to ``decode_wait_s``, then
            gets a 503 (default 96 Mi).
        score_chunk_pixels: most pixels converted to float32 (12 bytes each) for one reward
            call; a request's samples are scored in chunks of at most this many pixels, and a
            sample (an image, a clip) above it gets a 413 (default 16 Mi).
        decode_wait_s: see above (default 30 s).
        read_timeout_s: total deadline for a request's head, and separately its body, to arrive
            (default 60 s).
        max_connections: most open authenticated connections (that sent a request head with
            the token; with no token, any request head); more get a 503 (default 64).
        max_unauthenticated_connections: most open connections that have not authenticated;
            one more closes the oldest of them with a 503 (default 64).
        decode_threads: threads that parse, decode and score (default 4).
        allow_pickle: accept the pickle protocol (restricted to plain data; default True).

    :func:`~verl_digen.rewards.serve.memory_budget_bytes` gives the memory these bounds allow.
    """

    def __init__(
        self,
        reward: RewardFn | str,
        reward_kwargs: dict[str, Any] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_body_mb: float = DEFAULT_MAX_BODY_MB,
        max_body_total_mb: float = DEFAULT_MAX_BODY_TOTAL_MB,
        max_batch: int = 256,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS,
        max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS,
        score_chunk_pixels: int = DEFAULT_SCORE_CHUNK_PIXELS,
        decode_wait_s: float = DEFAULT_DECODE_WAIT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_unauthenticated_connections: int = DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS,
        decode_threads: int = DEFAULT_DECODE_THREADS,
        allow_pickle: bool = True,
        latency_s: float = 0.0,
    ) -> None:
        if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)) or not 0 <= latency_s < float("inf"):
            raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
        # A stand-in for a remote judge on its own GPU (benchmarks only): every answer is held
        # this long after scoring, concurrent requests overlapping as a judge's would.
        self.latency_s = float(latency_s)
        if isinstance(reward, str):
            reward = build_reward(reward, **(reward_kwargs or {}))
        elif reward_kwargs:
            raise ValueError("reward_kwargs is only used when reward is given by name")
        if not isinstance(reward, RewardFn):
            raise TypeError(f"reward must be a RewardFn or a registered name, got {type(reward).__name__}")
        check_options(
            max_body_mb=max_body_mb, max_body_total_mb=max_body_total_mb, read_timeout_s=read_timeout_s,
            decode_wait_s=decode_wait_s, max_batch=max_batch, max_image_pixels=max_image_pixels,
            max_request_pixels=max_request_pixels, max_decode_pixels=max_decode_pixels,
            score_chunk_pixels=score_chunk_pixels, max_connections=max_connections,
            max_unauthenticated_connections=max_unauthenticated_connections, decode_threads=decode_threads,
        )
        self.reward = reward
        self.reward_name = reward.name
        self.token = token or None
        self.max_body_bytes = int(max_body_mb * 1024 * 1024)
        self.max_body_total_bytes = int(max_body_total_mb * 1024 * 1024)
        self.max_batch = max_batch
        self.max_image_pixels = int(max_image_pixels)
        self.max_request_pixels = int(max_request_pixels)
        self.max_decode_pixels = int(max_decode_pixels)
        self.score_chunk_pixels = int(score_chunk_pixels)
        self.decode_wait_s = float(decode_wait_s)
        self.read_timeout_s = float(read_timeout_s)
        self.max_connections = max_connections
        self.max_unauthenticated_connections = max_unauthenticated_connections
        self.decode_threads = decode_threads
        self.allow_pickle = allow_pickle
        self.host = host
        self._reward_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._uvicorn: Any = None
        self._pixel_budget: Budget | None = None
        self._body_budget: Budget | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="reward-decode")
        warn_if_open(host, self.token)
        bind_host = host.strip("[]")
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((bind_host, port))
        except OSError:
            self._socket.close()
            raise
        self.port: int = self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000`` (POST to it or to ``url + "/score"``)."""
        host = self.host.strip("[]")
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------------ requests

    async def _handle(self, request: Request) -> Response:
        path = request.url.path.rstrip("/") or "/"
        method = request.method
        if path == HEALTH_PATH:
            if method in ("GET", "HEAD"):
                return JSONResponse({"status": "ok", "reward": self.reward_name, "latency_s": self.latency_s})
            raise RequestError(405, f"method {method} not allowed on {path}; use GET", headers={"Allow": "GET"})
        if path not in SCORE_PATHS:
            raise RequestError(404, f"unknown path {path!r}; POST to / or /score, GET /health")
        if method != "POST":
            raise RequestError(405, f"method {method} not allowed on {path}; use POST", headers={"Allow": "POST"})
        protocol = protocol_of(request.headers.get("content-type"))
        # answers before the body (401, 411, 413) go in the protocol the Content-Type names; none
        # is how Flow-GRPO's pickle clients post (requests sets no type for bytes)
        request.state.protocol = protocol or ("pickle" if self.allow_pickle else "json")
        check_auth(self.token, request.headers.get("authorization"))
        length = content_length(request.headers, self.max_body_bytes)
        if self._body_budget is None:  # made on the event loop
            self._body_budget = Budget(self.max_body_total_bytes, self.decode_wait_s, what="request-body budget",
                                       unit="bytes", option="--max-body-total-mb")
            self._pixel_budget = Budget(self.max_decode_pixels, self.decode_wait_s, what="decode budget",
                                        unit="pixels", option="--max-decode-pixels")
        bodies, pixels = self._body_budget, self._pixel_budget
        await bodies.acquire(length)
        held = length
        try:
            body = await read_body(request, length, self.read_timeout_s)
            if protocol is None:  # no Content-Type: a pickle starts with the PROTO opcode
                protocol = "pickle" if body[:1] == b"\x80" else "json"
            request.state.protocol = protocol  # errors answer in the request's protocol
            if protocol == "pickle" and not self.allow_pickle:
                raise RequestError(415, "this server does not accept pickle bodies (started with --no-pickle); send JSON")
            loop = asyncio.get_running_loop()
            limits = {"max_batch": self.max_batch, "max_image_pixels": self.max_image_pixels,
                      "max_request_pixels": self.max_request_pixels, "max_sample_pixels": self.score_chunk_pixels,
                      "reward_name": self.reward_name if getattr(self.reward, "reads_prompts", True) else None}
            parsed = await loop.run_in_executor(self._pool, lambda: parse_score_request(body, protocol, **limits))
            del body
            bodies.release(held - min(held, parsed.encoded_bytes))  # the encoded images stay until decoded
            held = min(held, parsed.encoded_bytes)
            await pixels.acquire(parsed.pixels)
            try:
                scores = await loop.run_in_executor(
                    self._pool, decode_and_score, self.reward, self._reward_lock, parsed, self.score_chunk_pixels
                )
            finally:
                pixels.release(parsed.pixels)
        finally:
            bodies.release(held)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if protocol == "pickle":
            # "outputs": what Flow-GRPO's UnifiedReward and DeQA clients read
            return Response(safe_dumps({"scores": scores, "rewards": scores, "outputs": scores}),
                            media_type="application/octet-stream")
        return JSONResponse({"rewards": scores})

    def score(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> list[float]:
        """Run the reward (serialised); raises :class:`RequestError` on failure: 422 when the
        reward raised or answered wrongly (it would again: no client retries a 4xx), 503 when it
        ran out of memory (that passes: clients retry a 503)."""
        with self._reward_lock:
            return call_reward(self.reward, images, prompts, metadata)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RewardServer:
        """Serve in a background thread; returns self once the server accepts connections."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("reward server already started")
        config = uvicorn.Config(
            _build_app(self),
            http=connection_class(self),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=2,
            backlog=max(64, self.max_connections + self.max_unauthenticated_connections),
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._socket]}, name="reward-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"reward server on {self.url} did not start")
            time.sleep(0.01)
        budget = memory_budget_bytes(
            max_decode_pixels=self.max_decode_pixels, max_image_pixels=self.max_image_pixels,
            decode_threads=self.decode_threads, score_chunk_pixels=self.score_chunk_pixels,
            max_body_total_mb=self.max_body_total_bytes / MIB,
        )
        logger.info("serving reward %r on %s (auth: %s; request memory up to %.0f MiB above idle, the reward's aside)",
                    self.reward_name, self.url, "token" if self.token else "none", budget / MIB)
        return self

    def stop(self) -> None:
        """Stop accepting requests and close the socket (idempotent)."""
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
            self._thread = None
        self._socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RewardServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
