"""Serve any registered reward over HTTP, speaking the protocol of :class:`HttpReward`.

Run a heavy reward (a large scoring model, a reward with conflicting dependencies) in its
own process, environment or machine, and point the trainer at it with the ``http`` reward::

    VERL_DIGEN_REWARD_TOKEN=s3cret python -m verl_digen.rewards.serve \\
        --reward clip_score --reward-kwargs '{"model_path": "/ckpt/clip"}' --port 8000

    # trainer side
    digen.reward.name=http digen.reward.kwargs.url=http://reward-host:8000/score \\
        digen.reward.kwargs.token=s3cret

Protocol (see :mod:`verl_digen.rewards.http_client`)::

    POST / or /score    {"prompts": [str, ...], "images": [<base64 PNG>, ...]}
                        -> 200 {"rewards": [float, ...]}
    GET  /health        -> 200 {"status": "ok", "reward": NAME}   (never needs the token)

Every error is answered with a JSON object ``{"error": "<message>"}``:

* 400: body not JSON / not UTF-8; not an object; ``prompts`` or ``images`` missing or not a
  list; a prompt that is not a string; ``prompts`` and ``images`` of different lengths; an
  image that is not a string, not valid base64, not a PNG, undecodable, larger than
  ``max_image_pixels``, or of a different size than image 0; an invalid Content-Length.
* 401: token configured and the ``Authorization: Bearer`` header missing or wrong.
* 404: unknown path. 405: a method other than POST on ``/`` or ``/score``.
* 411: no Content-Length (chunked bodies are not accepted).
* 408: the body did not arrive within ``read_timeout_s``.
* 413: Content-Length above ``max_body_mb`` (answered before reading the body), or more
  images than ``max_batch``.
* 500: the reward raised (message: exception type and text), or returned a wrong shape or
  non-finite values.

The server keeps serving after any of these. Reward calls are serialised with a lock
(rewards are not assumed thread-safe); requests are parsed and decoded concurrently.
Binds 127.0.0.1 by default; binding another interface without a token logs a loud warning.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import http.server
import io
import ipaddress
import json
import logging
import math
import os
import select
import signal
import socket
import sys
import threading
import time
import urllib.parse
from typing import Any

import numpy as np
import torch
from PIL import Image

from verl_digen.rewards.base import RewardFn, build_reward

__all__ = ["RewardServer", "RequestError", "TOKEN_ENV", "main"]

logger = logging.getLogger("verl_digen.rewards.serve")

TOKEN_ENV = "VERL_DIGEN_REWARD_TOKEN"
SCORE_PATHS = ("/", "/score")
HEALTH_PATH = "/health"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# After a 413 the unread body is discarded (never stored) for at most this long / this many
# bytes, so that a client that sends the whole body before reading (urllib does) reads the
# 413 instead of a connection reset.
_DRAIN_SECONDS = 2.0
_DRAIN_MAX_BYTES = 64 * 1024 * 1024


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


def parse_score_request(body: bytes, max_batch: int, max_image_pixels: int) -> tuple[list[str], torch.Tensor]:
    """Validate and decode a scoring request body; raises :class:`RequestError` (400/413)."""
    try:
        data: Any = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not UTF-8: {exc}") from None
    except ValueError as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(data).__name__}")
    missing = [key for key in ("prompts", "images") if key not in data]
    if missing:
        raise RequestError(400, f"request is missing field(s) {missing}; expected 'prompts' and 'images'")
    prompts, images = data["prompts"], data["images"]
    for key, value in (("prompts", prompts), ("images", images)):
        if not isinstance(value, list):
            raise RequestError(400, f"'{key}' must be a list, got {type(value).__name__}")
    if len(prompts) != len(images):
        raise RequestError(400, f"got {len(prompts)} prompts but {len(images)} images; they must match")
    if len(images) > max_batch:
        raise RequestError(413, f"batch of {len(images)} images exceeds the server limit of {max_batch}")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise RequestError(400, f"prompt {index} must be a string, got {type(prompt).__name__}")
    return prompts, decode_png_batch(images, max_image_pixels)


def decode_png_batch(encoded: list[Any], max_image_pixels: int) -> torch.Tensor:
    """Base64 PNGs -> float32 ``[N, 3, H, W]`` in ``[0, 1]`` (same result as
    :func:`~verl_digen.rewards.http_client.decode_images_png_b64`, but PNG only, size-checked
    before decompression, and raising :class:`RequestError` naming the image)."""
    arrays: list[np.ndarray] = []
    for index, item in enumerate(encoded):
        if not isinstance(item, str):
            raise RequestError(400, f"image {index} must be a base64 string, got {type(item).__name__}")
        try:
            raw = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RequestError(400, f"image {index} is not valid base64: {exc}") from None
        if not raw.startswith(_PNG_SIGNATURE):
            raise RequestError(400, f"image {index} is not a PNG (bad signature)")
        try:
            with Image.open(io.BytesIO(raw), formats=["PNG"]) as image:
                width, height = image.size
                if width * height > max_image_pixels:
                    raise RequestError(
                        400, f"image {index} is {width}x{height}, above the limit of {max_image_pixels} pixels"
                    )
                array = np.asarray(image.convert("RGB"))
        except RequestError:
            raise
        except Exception as exc:  # truncated data, bad chunks, decompression bomb, ...
            raise RequestError(400, f"image {index} could not be decoded as PNG: {type(exc).__name__}: {exc}") from None
        if arrays and array.shape != arrays[0].shape:
            raise RequestError(
                400,
                f"image {index} has size {array.shape[:2]} but image 0 has {arrays[0].shape[:2]}; "
                "all images in a request must have the same size",
            )
        arrays.append(array)
    if not arrays:
        return torch.zeros(0, 3, 1, 1)
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0


# --------------------------------------------------------------------------- HTTP handler


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "verl-digen-reward/0.1"
    sys_version = ""
    server: _HTTPServer

    def setup(self) -> None:
        self.timeout = self.server.app.read_timeout_s  # socket timeout for slow or stalled clients
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s - %s", self.address_string(), format % args)

    # -- replies

    def _reply(
        self, status: int, payload: dict[str, Any], *, close: bool = False, headers: dict[str, str] | None = None
    ) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:  # the client left
            self.close_connection = True

    def _error(self, exc: RequestError, *, body_read: bool) -> None:
        if exc.status >= 500:
            logger.error("%s %s -> %d: %s", self.command, self.path, exc.status, exc.message)
        else:
            logger.warning("%s %s -> %d: %s", self.command, self.path, exc.status, exc.message)
        # A body we did not read would be parsed as the next request: close the connection.
        self._reply(exc.status, {"error": exc.message}, close=not body_read, headers=exc.headers)

    # -- methods

    def do_GET(self) -> None:
        path = self._path()
        if path == HEALTH_PATH:
            return self._reply(200, {"status": "ok", "reward": self.server.app.reward_name})
        if path in SCORE_PATHS:
            return self._error(RequestError(405, f"use POST on {path}", headers={"Allow": "POST"}), body_read=True)
        self._error(RequestError(404, f"unknown path {path!r}; POST to / or /score, GET /health"), body_read=True)

    def do_POST(self) -> None:
        body_read = False
        try:
            path = self._path()
            if path not in SCORE_PATHS:
                raise RequestError(404, f"unknown path {path!r}; POST to / or /score, GET /health")
            self._check_auth()
            length = self._content_length()
            body = self._read_body(length)
            body_read = True
            prompts, images = parse_score_request(body, self.server.app.max_batch, self.server.app.max_image_pixels)
            rewards = self.server.app.score(images, prompts)
        except RequestError as exc:
            self._error(exc, body_read=body_read)
            if not body_read:
                self._drain_and_close()
            return
        except Exception as exc:  # a bug here must not kill the server; report it
            logger.exception("unexpected error while handling %s %s", self.command, self.path)
            self._error(RequestError(500, f"internal server error: {type(exc).__name__}: {exc}"), body_read=body_read)
            return
        self._reply(200, {"rewards": rewards})

    def _not_allowed(self) -> None:
        self._error(
            RequestError(405, f"method {self.command} not allowed", headers={"Allow": "GET, POST"}), body_read=False
        )
        self._drain_and_close()

    do_PUT = do_DELETE = do_PATCH = _not_allowed

    # -- helpers

    def _path(self) -> str:
        path = urllib.parse.urlsplit(self.path).path or "/"
        return path.rstrip("/") or "/"

    def _check_auth(self) -> None:
        token = self.server.app.token
        if not token:
            return
        challenge = {"WWW-Authenticate": 'Bearer realm="verl-digen-reward"'}
        header = self.headers.get("Authorization")
        if not header:
            raise RequestError(401, "missing 'Authorization: Bearer <token>' header", headers=challenge)
        scheme, _, provided = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(provided.strip().encode(), token.encode()):
            raise RequestError(401, "invalid token", headers=challenge)

    def _content_length(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(411, "chunked request bodies are not supported; send a Content-Length")
        value = self.headers.get("Content-Length")
        if value is None:
            raise RequestError(411, "missing Content-Length header")
        try:
            length = int(value)
        except ValueError:
            raise RequestError(400, f"invalid Content-Length {value!r}") from None
        if length < 0:
            raise RequestError(400, f"invalid Content-Length {value!r}")
        limit = self.server.app.max_body_bytes
        if length > limit:
            raise RequestError(
                413, f"request body of {length} bytes exceeds the server limit of {limit} bytes; send smaller batches"
            )
        return length

    def _read_body(self, length: int) -> bytes:
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(408, "timed out reading the request body") from None
        if len(body) != length:
            raise RequestError(400, f"request body ended after {len(body)} of {length} bytes")
        return body

    def _drain_and_close(self) -> None:
        """After an error reply sent before reading the body: discard (never store) what the
        client still sends, for at most ``_DRAIN_SECONDS`` / ``_DRAIN_MAX_BYTES``, then close.

        Closing a socket with unread data makes the kernel send a reset, which can destroy
        the error reply (a 413, 401, ...) before a client that sends its whole body first
        (urllib does) gets to read it.
        """
        try:
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            return
        deadline = time.monotonic() + _DRAIN_SECONDS
        drained = 0
        try:
            while drained < _DRAIN_MAX_BYTES:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                ready, _, _ = select.select([self.connection], [], [], remaining)
                if not ready:
                    break
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    app: RewardServer

    def handle_error(self, request: Any, client_address: Any) -> None:  # no raw tracebacks on stderr
        logger.warning("connection from %s ended with an error", client_address, exc_info=True)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


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
        max_batch: most images per request (default 256).
        max_image_pixels: largest accepted image, width * height (default 4096 * 4096).
        read_timeout_s: socket timeout while reading a request (default 60 s).
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
        read_timeout_s: float = 60.0,
    ) -> None:
        if isinstance(reward, str):
            reward = build_reward(reward, **(reward_kwargs or {}))
        elif reward_kwargs:
            raise ValueError("reward_kwargs is only used when reward is given by name")
        if not isinstance(reward, RewardFn):
            raise TypeError(f"reward must be a RewardFn or a registered name, got {type(reward).__name__}")
        if not max_body_mb > 0:
            raise ValueError(f"max_body_mb must be > 0, got {max_body_mb!r}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s!r}")
        self.reward = reward
        self.reward_name = reward.name
        self.token = token or None
        self.max_body_bytes = int(max_body_mb * 1024 * 1024)
        self.max_batch = max_batch
        self.max_image_pixels = int(max_image_pixels)
        self.read_timeout_s = float(read_timeout_s)
        self.host = host
        self._reward_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if not self.token and not is_loopback(host):
            logger.warning(
                "\n%s\nWARNING: reward server binding %s (not loopback) WITHOUT a token: anyone who can reach "
                "this port can use it. Set --token or %s.\n%s",
                "!" * 78,
                host,
                TOKEN_ENV,
                "!" * 78,
            )
        server_cls = _HTTPServer6 if ":" in host.strip("[]") else _HTTPServer
        self._httpd = server_cls((host.strip("[]"), port), _Handler)
        self._httpd.app = self
        self.port: int = self._httpd.server_address[1]

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

    def score(self, images: torch.Tensor, prompts: list[str]) -> list[float]:
        """Run the reward (serialised); raises :class:`RequestError` (500) on failure."""
        if len(prompts) == 0:
            return []
        with self._reward_lock:
            try:
                with torch.inference_mode():
                    scores = self.reward(images, prompts)
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

    def start(self) -> RewardServer:
        """Serve in a background thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("reward server already started")
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="reward-server", daemon=True
        )
        self._thread.start()
        logger.info("serving reward %r on %s (auth: %s)", self.reward_name, self.url, "token" if self.token else "none")
        return self

    def stop(self) -> None:
        """Stop accepting requests and close the socket (idempotent)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> RewardServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# --------------------------------------------------------------------------- CLI


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.rewards.serve",
        description="Serve a registered verl_digen reward over HTTP (the protocol of the 'http' reward).",
    )
    parser.add_argument("--reward", required=True, help="registered reward name, e.g. brightness, clip_score")
    parser.add_argument("--reward-kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument(
        "--token", default=None, help=f"bearer token required from clients (default: ${TOKEN_ENV}; prefer the env var)"
    )
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body, MiB (default 64)")
    parser.add_argument("--max-batch", type=int, default=256, help="most images per request (default 256)")
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
