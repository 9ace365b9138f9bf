"""Serve any registered reward over HTTP (FastAPI on uvicorn), in the protocols of :class:`HttpReward`.

Run a heavy reward (a large scoring model, a reward with conflicting dependencies) in its
own process, environment or machine, and point the trainer at it with the ``http`` reward::

    VERL_DIGEN_REWARD_TOKEN=s3cret python -m verl_digen.rewards.serve \\
        --reward clip_score --reward-kwargs '{"model_path": "/ckpt/clip"}' --port 8000

Protocols (see :mod:`verl_digen.rewards.http_client`)::

    POST / or /score   Content-Type: application/json
                       {"prompts": [str, ...], "images": [<base64 PNG>, ...] | "videos": [{"frames": [...], "fps": f}],
                        "metadata": [{...}, ...]}                               (metadata optional)
                       -> 200 {"rewards": [float, ...]}
    POST / or /score   Content-Type: application/octet-stream (or no type, a pickle body)
                       pickle {"images": [<JPEG/PNG bytes>, ...] | "videos": [...], "prompts": [...],
                               "metadata" or "meta_datas": [...]}
                       -> 200 pickle {"scores": [float, ...], "rewards": [float, ...]}
    GET  /health       -> 200 {"status": "ok", "reward": NAME}   (never needs the token)

Pickle bodies are read with the restricted unpickler (:mod:`verl_digen.rewards.safe_pickle`):
plain data only; ``allow_pickle=False`` (``--no-pickle``) refuses them.

Every error is a JSON object ``{"error": "<message>"}``, whatever the method or status:

* 400: body not JSON (or not a plain-data pickle) / not UTF-8 / nested deeper than
  ``MAX_JSON_DEPTH``; not an object; ``prompts`` or ``images`` missing or not a list; a prompt
  that is not a string; lengths that differ; an image that is not a string (bytes for pickle),
  not valid base64, not a PNG (JSON) / PNG or JPEG (pickle), undecodable, larger than
  ``max_image_pixels``, or of a different size than image 0; an invalid or duplicated
  ``Content-Length``; a malformed HTTP request.
* 401: token configured and the ``Authorization: Bearer`` header missing or wrong.
* 404: unknown path. 405: a method other than POST on ``/`` or ``/score`` (other than GET on ``/health``).
* 408: the request (head and body) did not arrive within ``read_timeout_s`` in total.
* 411: no Content-Length (chunked bodies are not accepted).
* 413: Content-Length above ``max_body_mb`` (answered before reading the body), more samples
  than ``max_batch``, or more pixels than ``max_request_pixels`` in one request.
* 415: a pickle body when pickle is off.
* 500: the reward raised (message: exception type and text), or returned a wrong shape or
  non-finite values.
* 503: more than ``max_connections`` connections, or the global decode budget
  (``max_decode_pixels`` across concurrent requests) stayed full for ``decode_wait_s``
  (``Retry-After`` is set; clients retry 503).

Bounds: the event loop reads requests without a thread per connection; parsing, decoding and
scoring run on ``decode_threads`` threads; reward calls are serialised with a lock (rewards
are not assumed thread-safe), so one slow client never blocks another. Binds 127.0.0.1 by
default; binding another interface without a token logs a loud warning.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import concurrent.futures
import hmac
import io
import ipaddress
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from verl_digen.rewards.base import RewardFn, build_reward
from verl_digen.rewards.safe_pickle import UnsafePickleError, safe_dumps, safe_loads

__all__ = ["RewardServer", "RequestError", "TOKEN_ENV", "MAX_JSON_DEPTH", "main"]

logger = logging.getLogger("verl_digen.rewards.serve")

TOKEN_ENV = "VERL_DIGEN_REWARD_TOKEN"
SCORE_PATHS = ("/", "/score")
HEALTH_PATH = "/health"
MAX_JSON_DEPTH = 32  # the protocol needs 4 (object > videos > clip > frames); metadata gets the rest
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SIGNATURE = b"\xff\xd8\xff"
_PICKLE_TYPES = ("application/octet-stream", "application/x-pickle", "application/python-pickle")
_MAX_HEAD_BYTES = 64 * 1024


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with a JSON ``{"error": message}``."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- request parsing

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """True when the JSON text ``body`` nests arrays/objects deeper than ``limit``.

    Python's json parser recurses and fails with RecursionError (a 500 that clients retry) on
    deep input; no parser option bounds depth, so we measure it first: strings are blanked out,
    then the running bracket depth is summed in 1 MiB numpy chunks (bounded memory)."""
    structure = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    depth = 0
    for start in range(0, structure.size, 1 << 20):
        chunk = structure[start : start + (1 << 20)]
        steps = (chunk == ord("[")).astype(np.int32) + (chunk == ord("{")) - (chunk == ord("]")) - (chunk == ord("}"))
        running = np.cumsum(steps, dtype=np.int64) + depth
        if running.size and int(running.max()) > limit:
            return True
        depth = int(running[-1]) if running.size else depth
    return False


@dataclass
class ScoreRequest:
    """A validated request whose images are measured (headers read) but not yet decoded."""

    protocol: str  # json | pickle
    prompts: list[str]
    metadata: list[dict[str, Any]]
    items: list[list[bytes]]  # per sample: one image, or the frames of a clip
    video: bool
    pixels: int  # total decoded pixels


def parse_score_request(
    body: bytes,
    protocol: str,
    *,
    max_batch: int,
    max_image_pixels: int,
    max_request_pixels: int,
) -> ScoreRequest:
    """Validate a scoring request body and measure its images (no decoding yet); raises
    :class:`RequestError` (400/413)."""
    data = _load_body(body, protocol)
    if not isinstance(data, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(data).__name__}")
    kind = "videos" if "videos" in data else "images"
    missing = [key for key in ("prompts", kind) if key not in data]
    if missing:
        raise RequestError(400, f"request is missing field(s) {missing}; expected 'prompts' and 'images' (or 'videos')")
    prompts, samples = data["prompts"], data[kind]
    for key, value in (("prompts", prompts), (kind, samples)):
        if not isinstance(value, (list, tuple)):
            raise RequestError(400, f"'{key}' must be a list, got {type(value).__name__}")
    if len(prompts) != len(samples):
        raise RequestError(400, f"got {len(prompts)} prompts but {len(samples)} {kind}; they must match")
    if len(samples) > max_batch:
        raise RequestError(413, f"batch of {len(samples)} {kind} exceeds the server limit of {max_batch}")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise RequestError(400, f"prompt {index} must be a string, got {type(prompt).__name__}")
    metadata = _metadata(data, len(prompts))
    items: list[list[bytes]] = []
    for index, sample in enumerate(samples):
        if kind == "videos":
            if not isinstance(sample, dict) or not isinstance(sample.get("frames"), (list, tuple)) or not sample["frames"]:
                raise RequestError(400, f"video {index} must be an object with a non-empty 'frames' list")
            fps = sample.get("fps")
            if fps is not None:
                if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
                    raise RequestError(400, f"video {index}: 'fps' must be a finite number > 0, got {fps!r}")
                metadata[index] = {**metadata[index], "fps": float(fps)}
            frames = [_raw_image(f, f"video {index} frame {k}", protocol) for k, f in enumerate(sample["frames"])]
        else:
            frames = [_raw_image(sample, f"image {index}", protocol)]
        items.append(frames)
    pixels = _measure(items, kind, protocol, max_image_pixels)
    if pixels > max_request_pixels:
        raise RequestError(
            413, f"request decodes to {pixels} pixels, above the server's per-request budget of {max_request_pixels}; "
            "send smaller batches"
        )
    return ScoreRequest(protocol, list(prompts), metadata, items, kind == "videos", pixels)


def _load_body(body: bytes, protocol: str) -> Any:
    if protocol == "pickle":
        try:
            return safe_loads(body)
        except UnsafePickleError as exc:
            raise RequestError(400, f"request body is not a plain-data pickle: {exc}") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not UTF-8: {exc}") from None
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise RequestError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise RequestError(400, "request body nests too deeply") from None
    except ValueError as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None


def _metadata(data: dict[str, Any], count: int) -> list[dict[str, Any]]:
    key = next((k for k in ("metadata", "meta_datas") if k in data), None)
    if key is None or data[key] is None:
        return [{} for _ in range(count)]
    records = data[key]
    if not isinstance(records, (list, tuple)) or len(records) != count:
        got = f"{len(records)} records" if isinstance(records, (list, tuple)) else type(records).__name__
        raise RequestError(400, f"'{key}' must be a list of {count} records (one per sample), got {got}")
    out = []
    for index, record in enumerate(records):
        if record is None:
            record = {}
        if not isinstance(record, dict):
            raise RequestError(400, f"'{key}' record {index} must be an object, got {type(record).__name__}")
        out.append(record)
    return out


def _raw_image(item: Any, what: str, protocol: str) -> bytes:
    if protocol == "pickle":
        if not isinstance(item, (bytes, bytearray)):
            raise RequestError(400, f"{what} must be encoded image bytes, got {type(item).__name__}")
        raw = bytes(item)
        if not raw.startswith((_PNG_SIGNATURE, _JPEG_SIGNATURE)):
            raise RequestError(400, f"{what} is not a PNG or JPEG (bad signature)")
        return raw
    if not isinstance(item, str):
        raise RequestError(400, f"{what} must be a base64 string, got {type(item).__name__}")
    try:
        raw = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(400, f"{what} is not valid base64: {exc}") from None
    if not raw.startswith(_PNG_SIGNATURE):
        raise RequestError(400, f"{what} is not a PNG (bad signature)")
    return raw


def _formats(protocol: str) -> list[str]:
    return ["PNG"] if protocol == "json" else ["PNG", "JPEG"]


def _name(kind: str, index: int, frame: int) -> str:
    return f"image {index}" if kind == "images" else f"video {index} frame {frame}"


def _measure(items: list[list[bytes]], kind: str, protocol: str, max_image_pixels: int) -> int:
    """Read every image's header (no decompression): per-image limit, equal sizes, total pixels."""
    first: tuple[int, int, int] | None = None
    total = 0
    for index, frames in enumerate(items):
        for frame, raw in enumerate(frames):
            what = _name(kind, index, frame)
            try:
                with Image.open(io.BytesIO(raw), formats=_formats(protocol)) as image:
                    width, height = image.size
            except Exception as exc:
                raise RequestError(
                    400, f"{what} could not be decoded as {'/'.join(_formats(protocol))}: {type(exc).__name__}: {exc}"
                ) from None
            if width * height > max_image_pixels:
                raise RequestError(400, f"{what} is {width}x{height}, above the limit of {max_image_pixels} pixels")
            shape = (len(frames), height, width)
            if first is None:
                first = shape
            elif shape != first:
                raise RequestError(
                    400,
                    f"{what} has size {(height, width)} ({len(frames)} frames) but sample 0 has "
                    f"{first[1:]} ({first[0]} frames); all samples in a request must have the same size",
                )
            total += width * height
    return total


def decode_request(request: ScoreRequest) -> torch.Tensor:
    """Decode the measured images: float32 ``[N, 3, H, W]`` (or ``[N, 3, F, H, W]``) in ``[0, 1]``."""
    kind = "videos" if request.video else "images"
    samples = []
    for index, frames in enumerate(request.items):
        arrays = []
        for frame, raw in enumerate(frames):
            try:
                with Image.open(io.BytesIO(raw), formats=_formats(request.protocol)) as image:
                    arrays.append(np.asarray(image.convert("RGB")))
            except Exception as exc:  # truncated data, bad chunks, decompression bomb, ...
                what = _name(kind, index, frame)
                formats = "/".join(_formats(request.protocol))
                raise RequestError(400, f"{what} could not be decoded as {formats}: {type(exc).__name__}: {exc}") from None
        samples.append(np.stack(arrays))  # [F, H, W, 3]
    if not samples:
        return torch.zeros(0, 3, 1, 1)
    pixels = torch.from_numpy(np.stack(samples)).float().div_(255.0)  # [N, F, H, W, 3]
    if request.video:
        return pixels.permute(0, 4, 1, 2, 3).contiguous()
    return pixels[:, 0].permute(0, 3, 1, 2).contiguous()


# --------------------------------------------------------------------------- decode budget


class PixelBudget:
    """Pixels being decoded or scored across all requests, at most ``total`` at once.

    A request waits (asynchronously) until its pixels fit, for at most ``wait_s``; then
    :class:`RequestError` 503. Made on the server's event loop."""

    def __init__(self, total: int, wait_s: float) -> None:
        self.total = total
        self.wait_s = wait_s
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, pixels: int) -> None:
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.used + pixels <= self.total), self.wait_s)
            except asyncio.TimeoutError:
                raise RequestError(
                    503,
                    f"server busy: the decode budget of {self.total} pixels stayed full for {self.wait_s:g} s; retry later",
                    headers={"Retry-After": "1"},
                ) from None
            self.used += pixels

    async def release(self, pixels: int) -> None:
        async with self._cond:
            self.used -= pixels
            self._cond.notify_all()


# --------------------------------------------------------------------------- the app


def _json_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


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
            return _json_error(exc.status, exc.message, exc.headers)
        except Exception as exc:  # a bug here must not kill the server; report it
            logger.exception("unexpected error while handling %s %s", request.method, request.url.path)
            return _json_error(500, f"internal server error: {type(exc).__name__}: {exc}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - safety net
        return _json_error(500, f"internal server error: {type(exc).__name__}")

    return app


def _raw_json_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _protocol_class(server: RewardServer) -> type:
    """uvicorn's h11 protocol with what uvicorn has no setting for, each answered in JSON:

    * a connection cap (``max_connections``; uvicorn's ``limit_concurrency`` answers in plain text);
    * a deadline for the request head (uvicorn waits forever for a dripping head);
    * strict ``Content-Length``: digits only and at most one header (h11 merges identical
      duplicates, RFC 9110 8.6 allows that; behind a proxy it is a request-smuggling vector);
    * its 400 for malformed HTTP in JSON (uvicorn's is plain text)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class RewardProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head = b""
            self._in_head = True
            self._head_timer: asyncio.TimerHandle | None = None
            if len(self.connections) > server.max_connections:
                logger.warning("refusing a connection: %d open (max_connections)", len(self.connections) - 1)
                self._refuse(503, "Service Unavailable", f"server busy: more than {server.max_connections} connections")
                return
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            marker = self.cycle
            self._head_timer = self.loop.call_later(server.read_timeout_s, self._head_timeout, marker)

        def _head_timeout(self, marker: Any) -> None:
            idle = self.cycle is marker and (self.cycle is None or self.cycle.response_complete)
            if idle and self._in_head and not self.transport.is_closing():
                self._refuse(408, "Request Timeout", f"the request head did not arrive within {server.read_timeout_s:g} s")

        def _refuse(self, status: int, reason: str, message: str) -> None:
            if not self.transport.is_closing():
                self.transport.write(_raw_json_response(status, reason, message))
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            if self._in_head:
                self._head += data
                end = self._head.find(b"\r\n\r\n")
                if end >= 0 or len(self._head) > _MAX_HEAD_BYTES:
                    problem = _head_problem(self._head[: end if end >= 0 else _MAX_HEAD_BYTES])
                    self._in_head, self._head = False, b""
                    if problem:
                        logger.warning("refusing a request: %s", problem)
                        self._refuse(400, "Bad Request", problem)
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


# --------------------------------------------------------------------------- server


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
        max_batch: most samples per request (default 256).
        max_image_pixels: largest accepted image or frame, width * height (default 4096 * 4096).
        max_request_pixels: most pixels (all images, all frames) one request may decode
            (default 64 Mi: 64 images of 1024x1024).
        max_decode_pixels: most pixels being decoded or scored across concurrent requests;
            a request waits for room up to ``decode_wait_s``, then gets a 503 (default 128 Mi).
        decode_wait_s: see above (default 30 s).
        read_timeout_s: total deadline for a request's head, and separately its body, to arrive
            (default 60 s).
        max_connections: most open connections; more get a 503 (default 64).
        decode_threads: threads that parse, decode and score (default 4).
        allow_pickle: accept the pickle protocol (restricted to plain data; default True).
    """

    def __init__(
        self,
        reward: RewardFn | str,
        reward_kwargs: dict[str, Any] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_body_mb: float = 64.0,
        max_batch: int = 256,
        max_image_pixels: int = 4096 * 4096,
        max_request_pixels: int = 64 * 1024 * 1024,
        max_decode_pixels: int = 128 * 1024 * 1024,
        decode_wait_s: float = 30.0,
        read_timeout_s: float = 60.0,
        max_connections: int = 64,
        decode_threads: int = 4,
        allow_pickle: bool = True,
    ) -> None:
        if isinstance(reward, str):
            reward = build_reward(reward, **(reward_kwargs or {}))
        elif reward_kwargs:
            raise ValueError("reward_kwargs is only used when reward is given by name")
        if not isinstance(reward, RewardFn):
            raise TypeError(f"reward must be a RewardFn or a registered name, got {type(reward).__name__}")
        for key, value in (("max_body_mb", max_body_mb), ("read_timeout_s", read_timeout_s),
                           ("decode_wait_s", decode_wait_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
        for key, value in (("max_batch", max_batch), ("max_image_pixels", max_image_pixels),
                           ("max_request_pixels", max_request_pixels), ("max_decode_pixels", max_decode_pixels),
                           ("max_connections", max_connections), ("decode_threads", decode_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        if max_request_pixels > max_decode_pixels:
            raise ValueError(
                f"max_request_pixels={max_request_pixels} exceeds max_decode_pixels={max_decode_pixels}: "
                "such a request could never be decoded"
            )
        self.reward = reward
        self.reward_name = reward.name
        self.token = token or None
        self.max_body_bytes = int(max_body_mb * 1024 * 1024)
        self.max_batch = max_batch
        self.max_image_pixels = int(max_image_pixels)
        self.max_request_pixels = int(max_request_pixels)
        self.max_decode_pixels = int(max_decode_pixels)
        self.decode_wait_s = float(decode_wait_s)
        self.read_timeout_s = float(read_timeout_s)
        self.max_connections = max_connections
        self.decode_threads = decode_threads
        self.allow_pickle = allow_pickle
        self.host = host
        self._reward_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._uvicorn: Any = None
        self._budget: PixelBudget | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="reward-decode")
        if not self.token and not is_loopback(host):
            logger.warning(
                "\n%s\nWARNING: reward server binding %s (not loopback) WITHOUT a token: anyone who can reach "
                "this port can use it. Set --token or %s.\n%s",
                "!" * 78,
                host,
                TOKEN_ENV,
                "!" * 78,
            )
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
                return JSONResponse({"status": "ok", "reward": self.reward_name})
            raise RequestError(405, f"method {method} not allowed on {path}; use GET", headers={"Allow": "GET"})
        if path not in SCORE_PATHS:
            raise RequestError(404, f"unknown path {path!r}; POST to / or /score, GET /health")
        if method != "POST":
            raise RequestError(405, f"method {method} not allowed on {path}; use POST", headers={"Allow": "POST"})
        self._check_auth(request.headers.get("authorization"))
        length = self._content_length(request.headers)
        protocol = self._protocol(request.headers.get("content-type"))
        body = await self._read_body(request, length)
        if protocol is None:  # no Content-Type: a pickle starts with the PROTO opcode
            protocol = "pickle" if body[:1] == b"\x80" else "json"
        if protocol == "pickle" and not self.allow_pickle:
            raise RequestError(415, "this server does not accept pickle bodies (started with --no-pickle); send JSON")
        loop = asyncio.get_running_loop()
        limits = {"max_batch": self.max_batch, "max_image_pixels": self.max_image_pixels,
                  "max_request_pixels": self.max_request_pixels}
        parsed = await loop.run_in_executor(self._pool, lambda: parse_score_request(body, protocol, **limits))
        del body
        if self._budget is None:
            self._budget = PixelBudget(self.max_decode_pixels, self.decode_wait_s)
        await self._budget.acquire(parsed.pixels)
        try:
            scores = await loop.run_in_executor(self._pool, self._decode_and_score, parsed)
        finally:
            await self._budget.release(parsed.pixels)
        if protocol == "pickle":
            return Response(safe_dumps({"scores": scores, "rewards": scores}), media_type="application/octet-stream")
        return JSONResponse({"rewards": scores})

    def _decode_and_score(self, request: ScoreRequest) -> list[float]:
        images = decode_request(request)
        return self.score(images, request.prompts, request.metadata)

    def _check_auth(self, header: str | None) -> None:
        if not self.token:
            return
        challenge = {"WWW-Authenticate": 'Bearer realm="verl-digen-reward"'}
        if not header:
            raise RequestError(401, "missing 'Authorization: Bearer <token>' header", headers=challenge)
        scheme, _, provided = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(provided.strip().encode(), self.token.encode()):
            raise RequestError(401, "invalid token", headers=challenge)

    def _content_length(self, headers: Any) -> int:
        if headers.get("transfer-encoding"):
            raise RequestError(411, "chunked request bodies are not supported; send a Content-Length")
        value = headers.get("content-length")
        if value is None:
            raise RequestError(411, "missing Content-Length header")
        if not value.isascii() or not value.isdigit():  # also checked on the raw head
            raise RequestError(400, f"invalid Content-Length {value!r}")
        length = int(value)
        if length > self.max_body_bytes:
            raise RequestError(
                413,
                f"request body of {length} bytes exceeds the server limit of {self.max_body_bytes} bytes; "
                "send smaller batches",
            )
        return length

    def _protocol(self, content_type: str | None) -> str | None:
        if not content_type:
            return None
        kind = content_type.split(";")[0].strip().lower()
        if kind in _PICKLE_TYPES:
            return "pickle"
        return "json"

    async def _read_body(self, request: Request, length: int) -> bytes:
        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > length:  # h11 frames by Content-Length; this is a safety net
                    raise RequestError(400, f"request body is longer than its Content-Length {length}")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            body = await asyncio.wait_for(read(), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {self.read_timeout_s:g} s") from None
        if len(body) != length:
            raise RequestError(400, f"request body ended after {len(body)} of {length} bytes")
        return body

    def score(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> list[float]:
        """Run the reward (serialised); raises :class:`RequestError` (500) on failure."""
        if len(prompts) == 0:
            return []
        with self._reward_lock:
            try:
                with torch.inference_mode():
                    scores = self.reward(images, prompts, metadata)
            except Exception as exc:
                logger.exception("reward %r raised", self.reward_name)
                raise RequestError(500, f"reward {self.reward_name!r} failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(scores, torch.Tensor) or scores.shape != (len(prompts),):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise RequestError(500, f"reward {self.reward_name!r} returned {got}, expected ({len(prompts)},)")
        values = [float(v) for v in scores.detach().float().cpu().tolist()]
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise RequestError(500, f"reward {self.reward_name!r} returned non-finite values at indices {bad[:10]}")
        return values

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RewardServer:
        """Serve in a background thread; returns self once the server accepts connections."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("reward server already started")
        config = uvicorn.Config(
            _build_app(self),
            http=_protocol_class(self),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=2,
            backlog=max(64, self.max_connections),
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
        logger.info("serving reward %r on %s (auth: %s)", self.reward_name, self.url, "token" if self.token else "none")
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


# --------------------------------------------------------------------------- CLI


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.rewards.serve",
        description="Serve a registered verl_digen reward over HTTP (the protocols of the 'http' reward).",
    )
    parser.add_argument("--reward", required=True, help="registered reward name, e.g. brightness, clip_score")
    parser.add_argument("--reward-kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument(
        "--token", default=None, help=f"bearer token required from clients (default: ${TOKEN_ENV}; prefer the env var)"
    )
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body, MiB (default 64)")
    parser.add_argument("--max-batch", type=int, default=256, help="most samples per request (default 256)")
    parser.add_argument("--max-request-pixels", type=int, default=64 * 1024 * 1024,
                        help="most decoded pixels per request (default 64 Mi)")
    parser.add_argument("--max-decode-pixels", type=int, default=128 * 1024 * 1024,
                        help="most decoded pixels across concurrent requests (default 128 Mi)")
    parser.add_argument("--max-connections", type=int, default=64, help="most open connections (default 64)")
    parser.add_argument("--decode-threads", type=int, default=4, help="threads that decode and score (default 4)")
    parser.add_argument("--no-pickle", action="store_true", help="refuse the pickle protocol")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    try:
        args.reward_kwargs = json.loads(args.reward_kwargs)
    except ValueError as exc:
        parser.error(f"--reward-kwargs is not valid JSON: {exc}")
    if not isinstance(args.reward_kwargs, dict):
        parser.error("--reward-kwargs must be a JSON object")
    if args.token is None:
        args.token = os.environ.get(TOKEN_ENV) or None
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = RewardServer(
            args.reward,
            args.reward_kwargs,
            host=args.host,
            port=args.port,
            token=args.token,
            max_body_mb=args.max_body_mb,
            max_batch=args.max_batch,
            max_request_pixels=args.max_request_pixels,
            max_decode_pixels=args.max_decode_pixels,
            max_connections=args.max_connections,
            decode_threads=args.decode_threads,
            allow_pickle=not args.no_pickle,
        )
    except (ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    server.start()
    print(f"reward server ready: reward={server.reward_name} url={server.url}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        logger.info("reward server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
