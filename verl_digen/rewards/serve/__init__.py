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
                       -> 200 pickle {"scores": [float, ...], "rewards": [...], "outputs": [...]}

The pickle form also takes what the flow_grpo / veRL-Omni clients send: ``metadata`` as ``{}``
(veRL-Omni's HTTP scorer client) or ``{"meta_datas": [...]}`` (the GenEval service's shape);
``prompts`` as a numpy ``str`` array (Flow-GRPO's UnifiedReward client) or left out when each
record carries its ``prompt`` (Flow-GRPO's GenEval client), or left out altogether (its DeQA
client) when the served reward reads no prompts (``RewardFn.reads_prompts``); the answer's
``outputs`` is what Flow-GRPO's UnifiedReward and DeQA clients read.
    GET  /health       -> 200 {"status": "ok", "reward": NAME}   (never needs the token)

Pickle bodies are read with the restricted unpickler (:mod:`verl_digen.rewards.safe_pickle`):
plain data only; ``allow_pickle=False`` (``--no-pickle``) refuses them.

Every error is an object ``{"error": "<message>"}``, whatever the method or status: JSON, or a
pickle when the request was one (those clients unpickle every answer):

* 400: body not JSON (or not a plain-data pickle) / not UTF-8 / nested deeper than
  ``MAX_JSON_DEPTH``; not an object; ``images`` missing, ``prompts`` missing (to a reward
  that reads them), either not a list; a prompt that is not a string; lengths that differ; an image that is not a string (bytes for pickle),
  not valid base64, not a PNG (JSON) / PNG or JPEG (pickle), undecodable, larger than
  ``max_image_pixels``, or of a different size than image 0; an invalid or duplicated
  ``Content-Length``; a malformed HTTP request.
* 401: token configured and the ``Authorization: Bearer`` header missing or wrong (answered
  before the body: a pickle when the Content-Type is missing or a pickle type).
* 404: unknown path. 405: a method other than POST on ``/`` or ``/score`` (other than GET on ``/health``).
* 408: the request (head and body) did not arrive within ``read_timeout_s`` in total.
* 411: no Content-Length (chunked bodies are not accepted).
* 413: Content-Length above ``max_body_mb`` (answered before reading the body), more samples
  than ``max_batch``, more pixels than ``max_request_pixels`` in one request, or one sample
  (an image, a clip) of more pixels than ``score_chunk_pixels``.
* 415: a pickle body when pickle is off.
* 422: the reward raised (message: exception type and text), or returned a wrong shape or
  non-finite values: it would again, so no client retries it (Flow-GRPO's clients retry 500
  up to 1000 times). 500: a bug in the server's own handling only.
* 503: the reward ran out of memory (``Retry-After``); more than ``max_connections`` authenticated connections; a new connection while
  ``max_unauthenticated_connections`` others have not authenticated (the oldest of those is
  closed with this answer); the body budget (``max_body_total_mb`` of bodies across concurrent
  requests) or the decode budget (``max_decode_pixels``) stayed full for ``decode_wait_s``
  (``Retry-After`` is set; clients retry 503). Every message names the option that raises it.

Memory: a request's body is held (counted against ``max_body_total_mb``) while it is read and
parsed; its images are then decoded straight into one uint8 ``[N, F, H, W, 3]`` array (3 bytes
per pixel, counted against ``max_decode_pixels``; PIL's decoded image, 4 bytes per pixel of
the image being decoded, is copied out in bands), and converted to float32 for the reward a
chunk of at most ``score_chunk_pixels`` at a time, under the reward lock (so one float chunk
exists at a time). Peak above idle, worst case: 3 B x ``max_decode_pixels`` + 4 B x
min(``max_decode_pixels``, ``decode_threads`` x ``max_image_pixels``) + 12 B x
``score_chunk_pixels`` + 3 x ``max_body_total_mb`` (body, text and parsed strings), plus the
reward's own working memory: 928 MiB with the defaults (``docs/reward_server.md``; measured by
``benchmarks/reward_server_memory.py``).

Bounds: the event loop reads requests without a thread per connection; parsing, decoding and
scoring run on ``decode_threads`` threads; reward calls are serialised with a lock (rewards
are not assumed thread-safe), so one slow client never blocks another. Connections that have
not authenticated (no request head with the token yet; without a token: no request head yet)
have a budget of their own, so idle sockets never starve token-bearing clients. Binds
127.0.0.1 by default; binding another interface without a token logs a loud warning.
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

__all__ = ["RewardServer", "RequestError", "TOKEN_ENV", "MAX_JSON_DEPTH", "memory_budget_bytes", "main"]

logger = logging.getLogger("verl_digen.rewards.serve")

TOKEN_ENV = "VERL_DIGEN_REWARD_TOKEN"
SCORE_PATHS = ("/", "/score")
HEALTH_PATH = "/health"
MAX_JSON_DEPTH = 32  # the protocol needs 4 (object > videos > clip > frames); metadata gets the rest
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SIGNATURE = b"\xff\xd8\xff"
_PICKLE_TYPES = ("application/octet-stream", "application/x-pickle", "application/python-pickle")
_MAX_HEAD_BYTES = 64 * 1024
_MI = 1024 * 1024

# Defaults, shared by RewardServer and the CLI. With them the server's decode and parse memory
# stays under 1 GiB above idle, whatever the clients send (docs/reward_server.md, "Memory").
DEFAULT_MAX_BODY_MB = 64.0
DEFAULT_MAX_BODY_TOTAL_MB = 64.0
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_REQUEST_PIXELS = 64 * _MI
DEFAULT_MAX_DECODE_PIXELS = 96 * _MI
DEFAULT_SCORE_CHUNK_PIXELS = 16 * _MI
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
        + 3 * int(max_body_total_mb * _MI)
    )


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

_DEPTH_CHUNK = 1 << 20  # bytes scanned at a time by json_depth_exceeds
_JSON_CLASS = np.zeros(256, dtype=np.int8)  # what json_depth_exceeds looks for: 0 = nothing
_JSON_CLASS[[ord("["), ord("{")]] = 1
_JSON_CLASS[[ord("]"), ord("}")]] = -1
_JSON_CLASS[ord('"')] = 2
_JSON_CLASS[ord("\\")] = 3


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """True when the JSON text ``body`` nests arrays/objects deeper than ``limit``.

    Python's json parser recurses and fails with RecursionError (a 500 that clients retry) on
    deep input; no parser option bounds depth, so we measure it first, in 1 MiB numpy chunks
    (about 2 bytes of scratch per byte of a chunk, plus 8 per bracket, quote or backslash):
    brackets inside strings are skipped (a quote opens or closes a string unless an odd run of
    backslashes precedes it; the string state and a trailing backslash run carry over between
    chunks) and the running depth of the others is summed. (A regular expression that blanked
    strings out first took 8 bytes of memory and ~0.1 us per body byte: 480 MiB and 6 s for a
    60 MiB body of images.) Only valid JSON is measured exactly; json.loads rejects the rest."""
    data = np.frombuffer(body, dtype=np.uint8)
    depth, in_string, carry = 0, 0, 0  # carry: the backslashes that ended the previous chunk
    for start in range(0, data.size, _DEPTH_CHUNK):
        classes = _JSON_CLASS[data[start : start + _DEPTH_CHUNK]]
        size = classes.size
        where = np.flatnonzero(classes)
        kinds = classes[where]
        backslashes = where[kinds == 3]
        quotes = where[kinds == 2]
        escaped = np.zeros(quotes.size, dtype=bool)
        run_starts = backslashes[:0]
        if backslashes.size:
            starts = np.ones(backslashes.size, dtype=bool)
            starts[1:] = backslashes[1:] != backslashes[:-1] + 1
            run_starts = backslashes[starts]
            run_ends = np.append(backslashes[np.flatnonzero(starts)[1:] - 1], backslashes[-1])
            if quotes.size:  # the run of backslashes right before each quote, if any
                before = quotes - 1
                run = np.searchsorted(run_starts, before, side="right") - 1
                safe = np.maximum(run, 0)
                length = before - run_starts[safe] + 1 + np.where(run_starts[safe] == 0, carry, 0)
                escaped = (run >= 0) & (run_ends[safe] == before) & (length % 2 == 1)
        if carry % 2 and quotes.size and quotes[0] == 0:
            escaped[0] = True
        live = quotes[~escaped]  # the quotes that open or close a string
        brackets = where[(kinds == 1) | (kinds == -1)]
        outside = (np.searchsorted(live, brackets) + in_string) % 2 == 0
        running = np.cumsum(classes[brackets[outside]], dtype=np.int64) + depth
        if running.size:
            if int(running.max()) > limit:
                return True
            depth = int(running[-1])
        in_string = (in_string + live.size) % 2
        if backslashes.size and backslashes[-1] == size - 1:
            carry = int(size - run_starts[-1]) + (carry if run_starts[-1] == 0 else 0)
        else:
            carry = 0
    return False


@dataclass
class ScoreRequest:
    """A validated request whose images are measured (headers read) but not yet decoded."""

    protocol: str  # json | pickle
    prompts: list[str]
    metadata: list[dict[str, Any]]
    items: list[list[bytes]]  # per sample: one image, or the frames of a clip (emptied as they are decoded)
    video: bool
    pixels: int  # total decoded pixels
    sample_shape: tuple[int, int, int] = (1, 1, 1)  # (frames, height, width) of every sample
    encoded_bytes: int = 0  # total size of the encoded images


def parse_score_request(
    body: bytes,
    protocol: str,
    *,
    max_batch: int,
    max_image_pixels: int,
    max_request_pixels: int,
    max_sample_pixels: int | None = None,
    reward_name: str | None = None,
) -> ScoreRequest:
    """Validate a scoring request body and measure its images (no decoding yet); raises
    :class:`RequestError` (400/413). ``max_sample_pixels``: most pixels of one sample (an image,
    or all frames of a clip), the server's ``score_chunk_pixels``. ``reward_name``: the served
    reward when it reads prompts (a request without any is then refused naming it); None when
    it reads none (such a request gets empty prompts)."""
    data = _load_body(body, protocol)
    if not isinstance(data, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(data).__name__}")
    kind = "videos" if "videos" in data else "images"
    if kind not in data:
        raise RequestError(400, "request is missing field(s) ['images']; expected 'prompts' and 'images' (or 'videos')")
    samples = data[kind]
    # Flow-GRPO's UnifiedReward client sends its prompts as a numpy array of str
    prompts = data["prompts"].tolist() if isinstance(data.get("prompts"), np.ndarray) else data.get("prompts")
    for key, value in (("prompts", prompts), (kind, samples)):
        if value is not None and not isinstance(value, (list, tuple)):
            raise RequestError(400, f"'{key}' must be a list, got {type(value).__name__}")
    if len(samples) > max_batch:
        raise RequestError(413, f"batch of {len(samples)} {kind} exceeds the server limit of {max_batch} (--max-batch)")
    metadata = _metadata(data, len(samples))
    if prompts is None:
        prompts = _prompts_from_records(metadata, reward_name)
    if len(prompts) != len(samples):
        raise RequestError(400, f"got {len(prompts)} prompts but {len(samples)} {kind}; they must match")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise RequestError(400, f"prompt {index} must be a string, got {type(prompt).__name__}")
    prompts = [str(p) for p in prompts]  # numpy's str_ as str
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
    pixels, shape = _measure(items, kind, protocol, max_image_pixels)
    if pixels > max_request_pixels:
        raise RequestError(
            413, f"request decodes to {pixels} pixels, above the server's per-request budget of {max_request_pixels} "
            "(--max-request-pixels); send smaller batches"
        )
    sample = shape[0] * shape[1] * shape[2]
    if max_sample_pixels is not None and sample > max_sample_pixels:
        what = f"an image of {shape[2]}x{shape[1]}"
        if kind == "videos":
            what = f"a clip of {shape[0]} frames of {shape[2]}x{shape[1]}"
        raise RequestError(
            413, f"{what} is {sample} pixels, above the {max_sample_pixels} pixels the server converts for the reward "
            "at once (--score-chunk-pixels); send smaller samples or raise that option"
        )
    encoded = sum(len(raw) for frames in items for raw in frames)
    return ScoreRequest(protocol, list(prompts), metadata, items, kind == "videos", pixels, shape, encoded)


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


def _prompts_from_records(metadata: list[dict[str, Any]], reward_name: str | None) -> list[str]:
    """The prompts of a request that sends none: Flow-GRPO's GenEval client puts each in its
    record; its DeQA client sends images alone, which only a reward that reads no prompts
    (``reward_name`` None) can score: it gets empty ones."""
    prompts = [record.get("prompt") for record in metadata]
    if all(isinstance(p, str) for p in prompts):
        return prompts
    if reward_name is None:
        return ["" for _ in metadata]
    raise RequestError(400, f"reward {reward_name!r} reads prompts and the request has none: request is missing "
                            "field(s) ['prompts'] and its records carry no 'prompt'; expected 'prompts' and 'images' "
                            "(or 'videos'), or serve a reward that reads no prompts")


def _metadata(data: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """One record per sample, from the shapes the clients send: ``metadata`` as a list (ours),
    ``{}`` (veRL-Omni's HTTP scorer client: no records), or a dict holding ``meta_datas`` (the
    GenEval scorer service's shape); or a top-level ``meta_datas`` list (Flow-GRPO's GenEval client)."""
    key = next((k for k in ("metadata", "meta_datas") if k in data), None)
    if key is None or data[key] is None:
        return [{} for _ in range(count)]
    records = data[key]
    if key == "metadata" and isinstance(records, dict):
        if "meta_datas" in records:
            records, key = records["meta_datas"], "metadata.meta_datas"
        elif data.get("meta_datas") is not None:
            records, key = data["meta_datas"], "meta_datas"
        elif not records:
            return [{} for _ in range(count)]
        else:
            raise RequestError(400, f"'metadata' must be a list of {count} records, {{}} or {{'meta_datas': [...]}}, "
                                    f"got an object with keys {sorted(map(str, records))[:10]}")
    if isinstance(records, np.ndarray) and records.dtype.kind != "O":
        records = records.tolist()
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


def _measure(
    items: list[list[bytes]], kind: str, protocol: str, max_image_pixels: int
) -> tuple[int, tuple[int, int, int]]:
    """Read every image's header (no decompression): per-image limit, equal sizes; returns the
    total pixels and the (frames, height, width) of every sample."""
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
                raise RequestError(
                    400, f"{what} is {width}x{height}, above the limit of {max_image_pixels} pixels (--max-image-pixels)"
                )
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
    return total, first or (1, 1, 1)


_BAND_PIXELS = 1 << 18  # pixels copied out of PIL's decoded image at a time


def decode_request(request: ScoreRequest) -> np.ndarray:
    """Decode the measured images straight into one uint8 ``[N, F, H, W, 3]`` array (RGB).

    3 bytes per pixel; while an image is decoded PIL holds it too (4 bytes per pixel for RGB),
    and it is copied out a band of rows at a time (never a second whole copy). Each image's
    encoded bytes are dropped from ``request.items`` once it is decoded."""
    kind = "videos" if request.video else "images"
    frames, height, width = request.sample_shape
    if not request.items:
        return np.zeros((0, frames, height, width, 3), dtype=np.uint8)
    out = np.empty((len(request.items), frames, height, width, 3), dtype=np.uint8)
    formats = _formats(request.protocol)
    for index, sample in enumerate(request.items):
        for frame, raw in enumerate(sample):
            try:
                _decode_into(raw, out[index, frame], formats)
            except Exception as exc:  # truncated data, bad chunks, decompression bomb, ...
                what = _name(kind, index, frame)
                raise RequestError(
                    400, f"{what} could not be decoded as {'/'.join(formats)}: {type(exc).__name__}: {exc}"
                ) from None
            sample[frame] = b""
    return out


def _decode_into(raw: bytes, out: np.ndarray, formats: list[str]) -> None:
    """Decode one image into ``out`` (uint8 ``[H, W, 3]``), converting to RGB band by band."""
    height, width = out.shape[:2]
    with Image.open(io.BytesIO(raw), formats=formats) as image:
        if image.size != (width, height):
            raise ValueError(f"decoded size {image.size} differs from the header's {(width, height)}")
        image.load()
        rows = max(1, _BAND_PIXELS // width)
        for top in range(0, height, rows):
            bottom = min(height, top + rows)
            band = image.crop((0, top, width, bottom))
            if band.mode != "RGB":
                band = band.convert("RGB")
            out[top:bottom] = np.asarray(band)


def to_float(pixels: np.ndarray, *, video: bool, frames_first: bool = False) -> torch.Tensor:
    """uint8 ``[n, F, H, W, 3]`` -> float32 in ``[0, 1]``: ``[n, 3, H, W]`` for images,
    ``[n, 3, F, H, W]`` for clips, in one new tensor (the only float copy).

    ``frames_first``: lay a clip out as ``[n, F, 3, H, W]`` in memory and return it as a
    ``[n, 3, F, H, W]`` view, so that a reward scoring frame by frame (:class:`RewardFn`
    flattens to ``[n * F, 3, H, W]``) needs no second copy."""
    source = torch.from_numpy(pixels)
    count, frames, height, width, _ = source.shape
    if not video:
        out = torch.empty(count, 3, height, width, dtype=torch.float32)
        out.copy_(source[:, 0].permute(0, 3, 1, 2))
    elif frames_first:
        out = torch.empty(count, frames, 3, height, width, dtype=torch.float32)
        out.copy_(source.permute(0, 1, 4, 2, 3))
    else:
        out = torch.empty(count, 3, frames, height, width, dtype=torch.float32)
        out.copy_(source.permute(0, 4, 1, 2, 3))
    out.div_(255.0)
    return out.permute(0, 2, 1, 3, 4) if video and frames_first else out


# --------------------------------------------------------------------------- budgets


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


# --------------------------------------------------------------------------- the app


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


def _raw_json_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _protocol_class(server: RewardServer) -> type:
    """uvicorn's h11 protocol with what uvicorn has no setting for, each answered in JSON:

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
            if self._authenticated or not server._head_authorized(head):
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


def _head_authorization(head: bytes) -> bytes | None:
    """The first ``Authorization`` header's value in a raw request head, if any."""
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            return value.strip()
    return None


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

    :func:`memory_budget_bytes` gives the memory these bounds allow.
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
                return JSONResponse({"status": "ok", "reward": self.reward_name, "latency_s": self.latency_s})
            raise RequestError(405, f"method {method} not allowed on {path}; use GET", headers={"Allow": "GET"})
        if path not in SCORE_PATHS:
            raise RequestError(404, f"unknown path {path!r}; POST to / or /score, GET /health")
        if method != "POST":
            raise RequestError(405, f"method {method} not allowed on {path}; use POST", headers={"Allow": "POST"})
        protocol = self._protocol(request.headers.get("content-type"))
        # answers before the body (401, 411, 413) go in the protocol the Content-Type names; none
        # is how Flow-GRPO's pickle clients post (requests sets no type for bytes)
        request.state.protocol = protocol or ("pickle" if self.allow_pickle else "json")
        self._check_auth(request.headers.get("authorization"))
        length = self._content_length(request.headers)
        if self._body_budget is None:  # made on the event loop
            self._body_budget = Budget(self.max_body_total_bytes, self.decode_wait_s, what="request-body budget",
                                       unit="bytes", option="--max-body-total-mb")
            self._pixel_budget = Budget(self.max_decode_pixels, self.decode_wait_s, what="decode budget",
                                        unit="pixels", option="--max-decode-pixels")
        bodies, pixels = self._body_budget, self._pixel_budget
        await bodies.acquire(length)
        held = length
        try:
            body = await self._read_body(request, length)
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
                scores = await loop.run_in_executor(self._pool, self._decode_and_score, parsed)
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

    def _decode_and_score(self, request: ScoreRequest) -> list[float]:
        """Decode into uint8, then score chunks of at most ``score_chunk_pixels``, each converted
        to float32 under the reward lock (one float chunk at a time, whatever the concurrency)."""
        pixels = decode_request(request)
        count = len(request.prompts)
        frames, height, width = request.sample_shape
        step = max(1, self.score_chunk_pixels // (frames * height * width))
        frames_first = request.video and not self.reward.supports_video
        scores: list[float] = []
        for start in range(0, count, step):
            stop = min(count, start + step)
            with self._reward_lock:
                images = to_float(pixels[start:stop], video=request.video, frames_first=frames_first)
                try:
                    scores += self._score_locked(images, request.prompts[start:stop], request.metadata[start:stop])
                finally:
                    del images
        return scores

    def _head_authorized(self, head: bytes) -> bool:
        """Whether a raw request head carries the token (always, when there is none)."""
        if not self.token:
            return True
        value = _head_authorization(head)
        if value is None:
            return False
        scheme, _, provided = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(provided.strip(), self.token.encode())

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
                f"request body of {length} bytes exceeds the server limit of {self.max_body_bytes} bytes "
                "(--max-body-mb); send smaller batches",
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
            raise RequestError(
                408, f"the request body did not arrive within {self.read_timeout_s:g} s (--read-timeout-s)"
            ) from None
        if len(body) != length:
            raise RequestError(400, f"request body ended after {len(body)} of {length} bytes")
        return body

    def score(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> list[float]:
        """Run the reward (serialised); raises :class:`RequestError` on failure: 422 when the
        reward raised or answered wrongly (it would again: no client retries a 4xx), 503 when it
        ran out of memory (that passes: clients retry a 503)."""
        with self._reward_lock:
            return self._score_locked(images, prompts, metadata)

    def _score_locked(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None
    ) -> list[float]:
        if len(prompts) == 0:
            return []
        try:
            with torch.inference_mode():
                scores = self.reward(images, prompts, metadata)
        except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
            logger.exception("reward %r ran out of memory", self.reward_name)
            raise RequestError(503, f"reward {self.reward_name!r} ran out of memory ({type(exc).__name__}: {exc}); "
                                    "retry later or send smaller batches", headers={"Retry-After": "1"}) from None
        except Exception as exc:
            logger.exception("reward %r raised", self.reward_name)
            raise RequestError(422, f"reward {self.reward_name!r} failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(scores, torch.Tensor) or scores.shape != (len(prompts),):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise RequestError(422, f"reward {self.reward_name!r} returned {got}, expected ({len(prompts)},)")
        values = [float(v) for v in scores.detach().float().cpu().tolist()]
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise RequestError(422, f"reward {self.reward_name!r} returned non-finite values at indices {bad[:10]}")
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
            max_body_total_mb=self.max_body_total_bytes / _MI,
        )
        logger.info("serving reward %r on %s (auth: %s; request memory up to %.0f MiB above idle, the reward's aside)",
                    self.reward_name, self.url, "token" if self.token else "none", budget / _MI)
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
        epilog="Memory: request handling stays within 3 B x --max-decode-pixels + 4 B x min(--max-decode-pixels, "
               "--decode-threads x --max-image-pixels) + 12 B x --score-chunk-pixels + 3 x --max-body-total-mb "
               f"above idle, the reward's own memory aside: {memory_budget_bytes() / _MI:g} MiB with the defaults "
               "(docs/reward_server.md).",
    )
    parser.add_argument("--reward", required=True, help="registered reward name, e.g. brightness, clip_score")
    parser.add_argument("--reward-kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where a reward model runs: auto (default) = the GPU when one is visible "
                             "(CUDA_VISIBLE_DEVICES), else CPU; a device in --reward-kwargs wins")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument(
        "--token", default=None, help=f"bearer token required from clients (default: ${TOKEN_ENV}; prefer the env var)"
    )
    mib = _MI
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                        help=f"largest request body, MiB; larger: 413 before reading (default {DEFAULT_MAX_BODY_MB:g})")
    parser.add_argument("--max-body-total-mb", type=float, default=DEFAULT_MAX_BODY_TOTAL_MB,
                        help="most request-body MiB held across concurrent requests (while read and parsed; their "
                             "encoded images until scored); more wait up to --decode-wait-s, then 503 "
                             f"(default {DEFAULT_MAX_BODY_TOTAL_MB:g})")
    parser.add_argument("--max-batch", type=int, default=256, help="most samples per request (default 256)")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="largest image or frame, width x height, read from its header; larger: 400 "
                             f"(default {DEFAULT_MAX_IMAGE_PIXELS // mib} Mi = 4096x4096)")
    parser.add_argument("--max-request-pixels", type=int, default=DEFAULT_MAX_REQUEST_PIXELS,
                        help="most decoded pixels per request; more: 413 "
                             f"(default {DEFAULT_MAX_REQUEST_PIXELS // mib} Mi)")
    parser.add_argument("--max-decode-pixels", type=int, default=DEFAULT_MAX_DECODE_PIXELS,
                        help="most decoded pixels (3 bytes each) across concurrent requests; more wait up to "
                             f"--decode-wait-s, then 503 (default {DEFAULT_MAX_DECODE_PIXELS // mib} Mi)")
    parser.add_argument("--score-chunk-pixels", type=int, default=DEFAULT_SCORE_CHUNK_PIXELS,
                        help="most pixels converted to float32 (12 bytes each) for one reward call; requests are "
                             "scored in chunks of this size, a larger sample (image or clip) gets 413 "
                             f"(default {DEFAULT_SCORE_CHUNK_PIXELS // mib} Mi)")
    parser.add_argument("--decode-wait-s", type=float, default=DEFAULT_DECODE_WAIT_S,
                        help="how long a request waits for room in the body or decode budget before its 503, "
                             f"seconds (default {DEFAULT_DECODE_WAIT_S:g})")
    parser.add_argument("--read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S,
                        help="how long the server waits for a request's head, and then separately for its body, "
                             "in total (not per read), seconds; a slower client gets 408 and is disconnected "
                             f"(default {DEFAULT_READ_TIMEOUT_S:g})")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="most open authenticated connections (that sent a request with the token; without a "
                             f"token, any request); more: 503 (default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--max-unauthenticated-connections", type=int,
                        default=DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS,
                        help="most open connections that have not authenticated yet (idle, or no token sent); one "
                             "more closes the oldest of them with 503, so they never starve clients with the token "
                             f"(default {DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS})")
    parser.add_argument("--decode-threads", type=int, default=DEFAULT_DECODE_THREADS,
                        help=f"threads that parse, decode and score (default {DEFAULT_DECODE_THREADS})")
    parser.add_argument("--no-pickle", action="store_true", help="refuse the pickle protocol")
    parser.add_argument("--latency-s", type=float, default=0.0,
                        help="hold every answer this many seconds after scoring (concurrent requests overlap): a "
                             "stand-in for a remote judge on its own GPU, for benchmarks (default 0)")
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


def _fix_mmap_threshold() -> None:
    """Have glibc give image-sized blocks (1 MiB and up) back to the OS when they are freed.

    glibc raises its mmap threshold (up to 32 MiB) each time it frees a large block, so later
    blocks of that size come from per-thread arenas, which keep their high-water mark: with four
    decode threads the idle RSS then drifts up by tens of MiB per thread. Setting the threshold
    (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_`` would) turns that off. Only the
    CLI does this: it owns its process; an embedding program keeps its own malloc settings."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = -3 in glibc's malloc.h
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to fix
        pass


def reward_kwargs_on_device(reward: str, kwargs: dict[str, Any], device: str) -> dict[str, Any]:
    """The reward's kwargs with ``--device`` resolved (``auto``: the first visible GPU, else the
    CPU) for a reward that has a model; ``cuda`` without a visible GPU is refused."""
    import torch

    from verl_digen.rewards.base import with_device

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return with_device(reward, dict(kwargs), device)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    _fix_mmap_threshold()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = RewardServer(
            args.reward,
            reward_kwargs_on_device(args.reward, args.reward_kwargs, args.device),
            host=args.host,
            port=args.port,
            token=args.token,
            max_body_mb=args.max_body_mb,
            max_body_total_mb=args.max_body_total_mb,
            max_batch=args.max_batch,
            max_image_pixels=args.max_image_pixels,
            max_request_pixels=args.max_request_pixels,
            max_decode_pixels=args.max_decode_pixels,
            score_chunk_pixels=args.score_chunk_pixels,
            decode_wait_s=args.decode_wait_s,
            read_timeout_s=args.read_timeout_s,
            max_connections=args.max_connections,
            max_unauthenticated_connections=args.max_unauthenticated_connections,
            decode_threads=args.decode_threads,
            allow_pickle=not args.no_pickle,
            latency_s=args.latency_s,
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
    device = getattr(server.reward, "device", "cpu")
    print(f"reward server ready: reward={server.reward_name} device={device} url={server.url}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        logger.info("reward server stopped")
    return 0

