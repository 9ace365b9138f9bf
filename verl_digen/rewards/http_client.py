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
both ends of the protocol.
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
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.jpeg import to_uint8_hwc

__all__ = ["HttpReward", "RewardServerError", "encode_images_png_b64", "decode_images_png_b64"]

_RETRYABLE_STATUS = {429}  # plus every 5xx


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


class _Retryable(Exception):
    """Internal: an attempt failed in a way that is worth retrying.

    ``answered`` is True when the server did answer (with a retryable HTTP status).
    """

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


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
        if not timeout_s > 0:
            raise ValueError(f"reward 'http': timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(max_retries, int) or max_retries < 1:
            raise ValueError(f"reward 'http': max_retries must be an int >= 1, got {max_retries!r}")
        if not backoff_s >= 0:
            raise ValueError(f"reward 'http': backoff_s must be >= 0, got {backoff_s!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward 'http': batch_size must be an int >= 1, got {batch_size!r}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.token = token
        self.batch_size = batch_size

    def check_reachable(self) -> None:
        """Open (and close) a TCP connection to the server, with the same retries and backoff.

        Used before a run starts so an unreachable server stops it at once with a message that
        names the URL, instead of failing inside a rollout worker minutes later.
        """
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise RewardServerError(f"reward server URL {self.url!r} is not an http(s) URL")
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        last: Exception | None = None
        for attempt in range(1, self.max_retries + 1):
            if attempt > 1:
                time.sleep(self.backoff_s * 2 ** (attempt - 2))
            try:
                with socket.create_connection((parsed.hostname, port), timeout=self.timeout_s):
                    return
            except OSError as e:
                last = e
        raise RewardServerError(f"reward server {self.url} unreachable after {self.max_retries} attempts: {last}")

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        rewards: list[float] = []
        for start in range(0, images.shape[0], self.batch_size):
            stop = start + self.batch_size
            rewards.extend(self._request(prompts[start:stop], images[start:stop]))
        return torch.tensor(rewards, dtype=torch.float32)

    # ------------------------------------------------------------------ transport

    def _request(self, prompts: list[str], images: torch.Tensor) -> list[float]:
        body = json.dumps({"prompts": prompts, "images": encode_images_png_b64(images)}).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last_error: _Retryable | None = None
        for attempt in range(1, self.max_retries + 1):
            if attempt > 1:
                time.sleep(self.backoff_s * 2 ** (attempt - 2))
            try:
                payload = self._post_once(body, headers)
            except _Retryable as exc:
                last_error = exc
                continue
            return self._parse(payload, expected=len(prompts))
        assert last_error is not None
        outcome = "failed" if last_error.answered else "unreachable"
        raise RewardServerError(
            f"reward server {self.url} {outcome} after {self.max_retries} attempts: {last_error}"
        )

    def _post_once(self, body: bytes, headers: dict[str, str]) -> bytes:
        """One POST; returns the 2xx body, raises _Retryable or RewardServerError."""
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = _snippet(exc.read())
            message = f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
            if exc.code >= 500 or exc.code in _RETRYABLE_STATUS:
                raise _Retryable(message, answered=True) from exc
            raise RewardServerError(f"reward server {self.url} rejected the request: {message}") from exc
        except urllib.error.URLError as exc:  # connection refused, DNS failure, timeout while connecting
            reason = exc.reason
            raise _Retryable(str(reason) if not isinstance(reason, socket.timeout) else "timed out") from exc
        except (TimeoutError, socket.timeout) as exc:
            raise _Retryable(f"timed out after {self.timeout_s:g} s") from exc
        except (OSError, http.client.HTTPException) as exc:  # reset, aborted or truncated response
            raise _Retryable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc

    def _parse(self, payload: bytes, expected: int) -> list[float]:
        def bad(problem: str) -> RewardServerError:
            return RewardServerError(f"reward server {self.url} returned a malformed response: {problem}")

        try:
            data: Any = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad(f"not JSON ({exc}); body starts with {_snippet(payload)!r}") from None
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


def _snippet(payload: bytes, limit: int = 200) -> str:
    text = payload.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
