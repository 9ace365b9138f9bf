"""A reward computed by a remote HTTP server.

Protocol (one POST per chunk of at most ``batch_size`` images)::

    POST <url>
    Content-Type: application/json
    Authorization: Bearer <token>          (only if a token is given)

    {"prompts": ["...", ...], "images": ["<base64 PNG>", ...]}

    200 OK
    {"rewards": [0.12, ...]}               (one finite number per image)

Images are sent as 8-bit RGB PNG (lossless after quantising ``[0, 1]`` floats to 0..255).
Video is sent frame by frame (the base class averages the per-frame rewards).

Connection errors, timeouts and HTTP 5xx (and 429 Too Many Requests) are retried with
exponential backoff (``backoff_s * 2**k`` seconds before retry ``k + 1``) up to
``max_retries`` attempts in total; other 4xx answers and malformed responses are not
retried. Every failure raises :class:`RewardServerError` naming the URL.

:func:`encode_images_png_b64` / :func:`decode_images_png_b64` are the (de)serialisers for
both ends of the protocol. The transport helpers (:func:`post_with_retries`,
:func:`retry_with_backoff`, :func:`check_tcp_reachable`, ...) serve the ``vlm_judge`` reward too.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.jpeg import to_uint8_hwc

__all__ = ["HttpReward", "RewardServerError", "encode_images_png_b64", "decode_images_png_b64"]

_RETRYABLE_STATUS = {429}  # plus every 5xx
_T = TypeVar("_T")


class RewardServerError(RuntimeError):
    """The reward server could not be reached or gave an unusable answer."""


def encode_images_png_b64(images: torch.Tensor) -> list[str]:
    """``[N, 3, H, W]`` floats in ``[0, 1]`` -> one base64-encoded 8-bit RGB PNG per image."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"encode_images_png_b64 expects a [N, 3, H, W] tensor, got {shape}")
    encoded = []
    for array in to_uint8_hwc(images).numpy():
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


def decode_images_png_b64(encoded: Sequence[str]) -> torch.Tensor:
    """Inverse of :func:`encode_images_png_b64`: a float32 ``[N, 3, H, W]`` tensor in ``[0, 1]``.

    Every image must have the same size; any decodable image format is accepted and
    converted to RGB.
    """
    if isinstance(encoded, str):
        raise ValueError("decode_images_png_b64 expects a list of base64 strings, not a single string")
    if len(encoded) == 0:
        raise ValueError("decode_images_png_b64 got no images")
    arrays = []
    for index, item in enumerate(encoded):
        try:
            with Image.open(io.BytesIO(base64.b64decode(item, validate=True))) as image:
                arrays.append(np.asarray(image.convert("RGB")))
        except Exception as exc:  # binascii.Error, PIL.UnidentifiedImageError, TypeError, ...
            raise ValueError(f"image {index} is not a base64-encoded image: {exc}") from exc
        if arrays[-1].shape != arrays[0].shape:
            raise ValueError(
                f"image {index} has size {arrays[-1].shape[:2]} but image 0 has {arrays[0].shape[:2]}; "
                "all images must have the same size"
            )
    stacked = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    return stacked.float() / 255.0


# ---------------------------------------------------------------------- transport (shared with vlm_judge)
#
# ``name`` below is how errors name the endpoint, e.g. "reward server http://host:8000/score".


class RetryableError(Exception):
    """An attempt failed in a way that is worth retrying (connection error, timeout, 5xx, 429).

    ``answered`` is True when the server did answer (with a retryable HTTP status).
    """

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


def check_retry_settings(reward: str, *, timeout_s: float, max_retries: int, backoff_s: float) -> None:
    """Raise ``ValueError("reward '<reward>': ...")`` for a bad timeout, retry count or backoff."""
    if not timeout_s > 0:
        raise ValueError(f"reward '{reward}': timeout_s must be > 0, got {timeout_s!r}")
    if not isinstance(max_retries, int) or max_retries < 1:
        raise ValueError(f"reward '{reward}': max_retries must be an int >= 1, got {max_retries!r}")
    if not backoff_s >= 0:
        raise ValueError(f"reward '{reward}': backoff_s must be >= 0, got {backoff_s!r}")


def retry_with_backoff(attempt: Callable[[], _T], *, max_retries: int, backoff_s: float, name: str) -> _T:
    """``attempt()``, called again while it raises :class:`RetryableError`, up to ``max_retries``
    calls in total with ``backoff_s * 2**k`` seconds of sleep before retry ``k + 1``. Any other
    exception propagates at once. When every call failed, raises :class:`RewardServerError`:
    ``"<name> failed|unreachable after <n> attempts: <last error>"`` ("failed" when the server
    answered the last time)."""
    last_error: RetryableError | None = None
    for index in range(1, max_retries + 1):
        if index > 1:
            time.sleep(backoff_s * 2 ** (index - 2))
        try:
            return attempt()
        except RetryableError as exc:
            last_error = exc
    assert last_error is not None
    outcome = "failed" if last_error.answered else "unreachable"
    raise RewardServerError(f"{name} {outcome} after {max_retries} attempts: {last_error}")


def json_headers(token: str | None) -> dict[str, str]:
    """Headers of a JSON POST, with ``Authorization: Bearer <token>`` when a token is given."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def post_once(url: str, body: bytes, headers: dict[str, str], *, timeout_s: float, name: str) -> bytes:
    """One POST; returns the 2xx body. Raises :class:`RetryableError` for connection errors,
    timeouts, 5xx and 429, :class:`RewardServerError` for other HTTP errors."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        detail = snippet(exc.read())
        message = f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
        if exc.code >= 500 or exc.code in _RETRYABLE_STATUS:
            raise RetryableError(message, answered=True) from exc
        raise RewardServerError(f"{name} rejected the request: {message}") from exc
    except urllib.error.URLError as exc:  # connection refused, DNS failure, timeout while connecting
        reason = exc.reason
        raise RetryableError(str(reason) if not isinstance(reason, socket.timeout) else "timed out") from exc
    except (TimeoutError, socket.timeout) as exc:
        raise RetryableError(f"timed out after {timeout_s:g} s") from exc
    except (OSError, http.client.HTTPException) as exc:  # reset, aborted or truncated response
        raise RetryableError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc


def post_with_retries(
    url: str, body: bytes, token: str | None, *, timeout_s: float, max_retries: int, backoff_s: float, name: str
) -> bytes:
    """POST the JSON ``body`` (:func:`post_once`, :func:`json_headers`) with :func:`retry_with_backoff`;
    returns the 2xx body."""
    headers = json_headers(token)
    return retry_with_backoff(
        lambda: post_once(url, body, headers, timeout_s=timeout_s, name=name),
        max_retries=max_retries,
        backoff_s=backoff_s,
        name=name,
    )


def check_tcp_reachable(
    parsed: urllib.parse.SplitResult, name: str, *, timeout_s: float, max_retries: int, backoff_s: float
) -> None:
    """Open (and close) a TCP connection to the host of the URL ``parsed``, retried with backoff as
    :func:`retry_with_backoff`; raises ``RewardServerError("<name> unreachable after ...")``."""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)

    def connect() -> None:
        try:
            with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
                return
        except OSError as exc:
            raise RetryableError(str(exc)) from exc

    retry_with_backoff(connect, max_retries=max_retries, backoff_s=backoff_s, name=name)


def malformed_response(name: str, problem: str) -> RewardServerError:
    return RewardServerError(f"{name} returned a malformed response: {problem}")


def load_json_body(payload: bytes, name: str) -> Any:
    """``json.loads(payload)``; :func:`malformed_response` naming the body's start if it is not JSON."""
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise malformed_response(name, f"not JSON ({exc}); body starts with {snippet(payload)!r}") from None


def snippet(payload: bytes, limit: int = 200) -> str:
    """The start of a response body, for error messages."""
    text = payload.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


@register_reward("http")
class HttpReward(RewardFn):
    """Reward from a remote server speaking the JSON protocol in the module docstring.

    Args:
        url: endpoint to POST to, e.g. ``http://reward-host:8000/score``.
        timeout_s: per-request timeout (connect and read), seconds.
        max_retries: attempts per request in total, the first one included (>= 1).
        backoff_s: sleep before the first retry; doubles for each further retry.
        token: sent as ``Authorization: Bearer <token>`` if given.
        batch_size: images per request; larger batches are split into several requests.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        token: str | None = None,
        batch_size: int = 32,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"reward 'http': url must start with http:// or https://, got {url!r}")
        check_retry_settings("http", timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward 'http': batch_size must be an int >= 1, got {batch_size!r}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.token = token
        self.batch_size = batch_size

    @property
    def _server(self) -> str:
        """How errors name the server."""
        return f"reward server {self.url}"

    def check_reachable(self) -> None:
        """Open (and close) a TCP connection to the server, with the same retries and backoff.

        Used before a run starts so an unreachable server stops it at once with a message that
        names the URL, instead of failing inside a rollout worker minutes later.
        """
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise RewardServerError(f"reward server URL {self.url!r} is not an http(s) URL")
        check_tcp_reachable(
            parsed, self._server, timeout_s=self.timeout_s, max_retries=self.max_retries, backoff_s=self.backoff_s
        )

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        rewards: list[float] = []
        for start in range(0, images.shape[0], self.batch_size):
            stop = start + self.batch_size
            rewards.extend(self._request(prompts[start:stop], images[start:stop]))
        return torch.tensor(rewards, dtype=torch.float32)

    # ------------------------------------------------------------------ transport

    def _request(self, prompts: list[str], images: torch.Tensor) -> list[float]:
        body = json.dumps({"prompts": prompts, "images": encode_images_png_b64(images)}).encode("utf-8")
        retries = {"timeout_s": self.timeout_s, "max_retries": self.max_retries, "backoff_s": self.backoff_s}
        payload = post_with_retries(self.url, body, self.token, **retries, name=self._server)
        return self._parse(payload, expected=len(prompts))

    def _parse(self, payload: bytes, expected: int) -> list[float]:
        def bad(problem: str) -> RewardServerError:
            return malformed_response(self._server, problem)

        data = load_json_body(payload, self._server)
        if not isinstance(data, dict) or "rewards" not in data:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise bad(f"expected an object with a 'rewards' key, got {keys}")
        rewards = data["rewards"]
        if not isinstance(rewards, list):
            raise bad(f"'rewards' must be a list, got {type(rewards).__name__}")
        if len(rewards) != expected:
            raise bad(f"got {len(rewards)} rewards for {expected} images")
        for index, value in enumerate(rewards):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(f"reward {index} is not a finite number: {value!r}")
        return [float(value) for value in rewards]

    def __repr__(self) -> str:
        return f"HttpReward(url={self.url!r}, batch_size={self.batch_size}, max_retries={self.max_retries})"
