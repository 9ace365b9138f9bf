"""A reward computed by a remote HTTP server, in one of two protocols.

``protocol="json"`` (ours, the default; :mod:`verl_digen.rewards.serve` speaks it)::

    POST <url>   Content-Type: application/json   [Authorization: Bearer <token>]
    {"prompts": ["...", ...],
     "images": ["<base64 PNG>", ...],                         (images, or video frame by frame)
     "videos": [{"frames": ["<base64 PNG>", ...], "fps": 16}, ...],   (video="clip")
     "metadata": [{...prompt record...}, ...]}                (one per sample)
    -> 200 {"rewards": [0.12, ...]}                           ("scores" is accepted too)

``protocol="pickle"`` (the flow_grpo / ddpo ``reward-server`` and veRL-Omni HTTP scorer one)::

    POST <url>   Content-Type: application/octet-stream
    pickle.dumps({"images": [<JPEG bytes>, ...],              (or "videos": [{"frames": [...], "fps"}])
                  "prompts": [...],
                  "metadata": {"meta_datas": [...], **extra_fields},   (metadata_format="nested", the default;
                  "meta_datas": [...],                                  "list": a list under metadata_keys)
                  **extra_fields})                            (e.g. {"only_strict": False} for GenEval)
    -> 200 pickle.dumps({"scores": [...], ...})               ("rewards", "outputs" are accepted too)

The answer of a pickle server is unpickled with :func:`~verl_digen.rewards.safe_pickle.safe_loads`:
plain data only (anything else is a named error: unpickling can run code).

Images are quantised from ``[0, 1]`` floats to 8-bit RGB. Video is sent frame by frame and
the per-frame scores averaged (``video="frames"``, the default), or as whole clips
(``video="clip"``) for servers that score clips.

Transport (:mod:`verl_digen.rewards.transport`): a total deadline per attempt, no redirects
(a token never reaches another host), a response size cap, retries of connection errors,
timeouts, 5xx and 429 with exponential backoff; other 4xx answers and malformed responses
are not retried. Every failure raises :class:`RewardServerError` naming the URL.
"""

from __future__ import annotations

import base64
import io
import json
import math
import numbers
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from verl_digen.rewards.base import RewardFn, check_metadata, register_reward
from verl_digen.rewards.jpeg import to_uint8_hwc
from verl_digen.rewards.safe_pickle import UnsafePickleError, safe_dumps, safe_loads
from verl_digen.rewards.transport import (
    Endpoint,
    RetryableError,
    RewardServerError,
    check_retry_settings,
    check_tcp_reachable,
    malformed_response,
    parse_json_answer,
    snippet,
)

__all__ = [
    "HttpReward",
    "RewardServerError",
    "RetryableError",
    "encode_images_png_b64",
    "decode_images_png_b64",
    "encode_images_bytes",
    "parse_scores",
    "snippet",
]

PROTOCOLS = ("json", "pickle")
VIDEO_MODES = ("frames", "clip")


def encode_images_bytes(images: torch.Tensor, fmt: str = "PNG", quality: int = 95) -> list[bytes]:
    """``[N, 3, H, W]`` floats in ``[0, 1]`` -> one encoded 8-bit RGB image (PNG or JPEG) per image."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"image encoding expects a [N, 3, H, W] tensor, got {shape}")
    encoded = []
    for array in to_uint8_hwc(images).numpy():
        buffer = io.BytesIO()
        if fmt == "JPEG":
            Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        else:
            Image.fromarray(array).save(buffer, format=fmt)
        encoded.append(buffer.getvalue())
    return encoded


def encode_images_png_b64(images: torch.Tensor) -> list[str]:
    """``[N, 3, H, W]`` floats in ``[0, 1]`` -> one base64-encoded 8-bit RGB PNG per image."""
    return [base64.b64encode(raw).decode("ascii") for raw in encode_images_bytes(images, "PNG")]


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


def parse_scores(data: Any, expected: int, keys: Sequence[str], name: str) -> list[float]:
    """The finite scores under the first of ``keys`` in the answer ``data``; a malformed-response
    error naming the problem otherwise."""

    def bad(problem: str) -> RewardServerError:
        return malformed_response(name, problem)

    if not isinstance(data, dict):
        raise bad(f"expected an object with a {' or '.join(map(repr, keys))} key, got {type(data).__name__}")
    key = next((k for k in keys if k in data), None)
    if key is None:
        shown = sorted(map(str, data))[:20]
        raise bad(f"expected an object with a {' or '.join(map(repr, keys))} key, got keys {shown}")
    scores = data[key]
    if isinstance(scores, tuple):
        scores = list(scores)
    if isinstance(scores, np.ndarray) and scores.ndim == 1:  # a pickle server's numpy array
        scores = list(scores)
    if not isinstance(scores, list):
        raise bad(f"{key!r} must be a list, got {type(scores).__name__}")
    if len(scores) != expected:
        raise bad(f"got {len(scores)} {key} for {expected} samples")
    for index, value in enumerate(scores):
        # numbers.Real: int, float and numpy's numbers (HPS's server answers float32 scores)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise bad(f"score {index} is not a finite number: {value!r}")
    return [float(value) for value in scores]


#: A GenEval answer's per-sample fields besides the scores, under the metric names Flow-GRPO logs.
GENEVAL_LISTS = {"rewards": "accuracy", "strict_rewards": "strict_accuracy"}
#: ... and its per-group fields: ``{tag: [value or -10.0 where the sample is not of that tag]}``.
GENEVAL_GROUPS = {"group_rewards": "accuracy", "group_strict_rewards": "strict_accuracy"}
GENEVAL_ABSENT = -10.0


def _merge_chunks(chunks: list[dict[str, list[float]]], sizes: list[int]) -> dict[str, list[float]]:
    """One list per extra over all chunks of a call, NaN for the samples of a chunk without it
    (a group no sample of that chunk had)."""
    names = sorted({k for chunk in chunks for k in chunk})
    return {k: [v for chunk, n in zip(chunks, sizes) for v in chunk.get(k, [math.nan] * n)] for k in names}


def geneval_extras(data: Any, expected: int, name: str) -> dict[str, list[float]]:
    """The per-sample extras of a GenEval scorer's answer (reward-server's GenEval app, the GenEval
    service), named as Flow-GRPO logs them: ``accuracy`` (``rewards``), ``strict_accuracy``
    (``strict_rewards``), ``<tag>_accuracy`` / ``<tag>_strict_accuracy`` (``group_rewards`` /
    ``group_strict_rewards``; NaN for a sample of another tag, where GenEval writes -10.0). Empty
    for an answer without ``strict_rewards`` (not GenEval's): other servers' ``rewards`` stay
    theirs. A malformed field is a malformed-response error naming it."""
    if not isinstance(data, dict) or "strict_rewards" not in data:
        return {}
    extras = {metric: parse_scores(data, expected, [key], name) for key, metric in GENEVAL_LISTS.items() if key in data}
    for key, metric in GENEVAL_GROUPS.items():
        groups = data.get(key, {})
        if not isinstance(groups, dict):
            raise malformed_response(name, f"{key!r} must be an object of per-tag lists, got {type(groups).__name__}")
        for tag, _ in sorted(groups.items()):
            values = parse_scores(groups, expected, [tag], name)
            extras[f"{tag}_{metric}"] = [math.nan if v == GENEVAL_ABSENT else v for v in values]
    return extras


@register_reward("http")
class HttpReward(RewardFn):
    """Reward from a remote server speaking the JSON or the pickle protocol (module docstring).

    Args:
        url: endpoint to POST to, e.g. ``http://reward-host:8000/score``.
        protocol: ``"json"`` (ours) or ``"pickle"`` (flow_grpo / ddpo reward servers, veRL-Omni).
        timeout_s: total deadline of one attempt (connect, send, and the whole answer), seconds.
        max_retries: attempts per request in total, the first one included (>= 1).
        backoff_s: sleep before the first retry; doubles for each further retry.
        token: sent as ``Authorization: Bearer <token>`` if given.
        batch_size: samples per request; larger batches are split into several requests.
        concurrency: requests in flight at once (>= 1).
        video: ``"frames"``: each frame is scored as an image and the scores averaged;
            ``"clip"``: whole clips are sent (``videos`` with ``frames`` and ``fps``).
        fps: frames per second sent with clips.
        max_response_mb: largest answer accepted, MiB.
        metadata_format: how the pickle protocol carries the per-sample records. ``"nested"``
            (default): ``metadata`` is an object, ``{"meta_datas": [records], **extra_fields}``,
            as veRL-Omni's client sends an object there and the GenEval scorer service reads
            ``metadata["meta_datas"]`` (and ``only_strict`` beside it), and ``meta_datas`` is the
            list again at the top level, where flow_grpo's reward-server GenEval app reads it;
            ``"list"``: the list under each of ``metadata_keys``.
        metadata_keys: the request fields that carry the records with ``metadata_format="list"``.
        extra_fields: more request fields, sent as they are (e.g. ``{"only_strict": false}``).
        score_key: the answer's field with the scores (default: ``rewards`` then ``scores``
            for JSON, ``scores``, ``rewards`` then ``outputs`` (flow_grpo's DeQA app) for pickle).
        jpeg_quality: JPEG quality of the pickle protocol's images.
    """

    supports_video = True  # handled here: frame by frame or as clips

    def __init__(
        self,
        url: str,
        protocol: str = "json",
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        token: str | None = None,
        batch_size: int = 32,
        concurrency: int = 1,
        video: str = "frames",
        fps: float = 16.0,
        max_response_mb: float = 16.0,
        metadata_keys: Sequence[str] = ("metadata", "meta_datas"),
        extra_fields: Mapping[str, Any] | None = None,
        metadata_format: str = "nested",
        score_key: str | None = None,
        jpeg_quality: int = 95,
    ) -> None:
        def bad(message: str) -> ValueError:
            return ValueError(f"reward 'http': {message}")

        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise bad(f"url must start with http:// or https://, got {url!r}")
        if protocol not in PROTOCOLS:
            raise bad(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        check_retry_settings(
            "http", timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, max_response_mb=max_response_mb
        )
        for key, value in (("batch_size", batch_size), ("concurrency", concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(f"{key} must be an int >= 1, got {value!r}")
        if video not in VIDEO_MODES:
            raise bad(f"video must be one of {', '.join(VIDEO_MODES)}, got {video!r}")
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
            raise bad(f"fps must be a finite number > 0, got {fps!r}")
        if isinstance(metadata_keys, str) or not all(isinstance(k, str) and k for k in metadata_keys):
            raise bad(f"metadata_keys must be a list of field names, got {metadata_keys!r}")
        if metadata_format not in ("nested", "list"):
            raise bad(f"metadata_format must be 'nested' or 'list', got {metadata_format!r}")
        extra = dict(extra_fields or {})
        reserved = {"images", "videos", "prompts", "fps", "metadata", "meta_datas", *metadata_keys} & set(extra)
        if reserved:
            raise bad(f"extra_fields may not set {sorted(reserved)} (the protocol's own fields)")
        if not isinstance(jpeg_quality, int) or not 1 <= jpeg_quality <= 100:
            raise bad(f"jpeg_quality must be an int in [1, 100], got {jpeg_quality!r}")
        self.url = url
        self.protocol = protocol
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.token = token
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.video = video
        self.fps = float(fps)
        self.max_response_bytes = int(max_response_mb * 1024 * 1024)
        self.metadata_keys = list(metadata_keys) if protocol == "pickle" else ["metadata"]
        self.metadata_format = metadata_format if protocol == "pickle" else "list"
        self.extra_fields = extra
        default_keys = ["rewards", "scores"] if protocol == "json" else ["scores", "rewards", "outputs"]
        self.score_keys = [score_key] if score_key else default_keys
        self.jpeg_quality = jpeg_quality

    @property
    def _server(self) -> str:
        """How errors name the server."""
        return f"reward server {self.url}"

    def _endpoint(self) -> Endpoint:
        return Endpoint(
            self.url,
            name=self._server,
            token=self.token,
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            backoff_s=self.backoff_s,
            max_response_bytes=self.max_response_bytes,
            concurrency=self.concurrency,
        )

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

    # ------------------------------------------------------------------ scoring

    def score_images(
        self, images: torch.Tensor, prompts: list[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> torch.Tensor:
        records = [dict(r) for r in check_metadata(self.name, metadata, len(prompts))]
        images = images.detach().cpu()
        if images.dim() == 5 and self.video == "frames":
            batch, _, frames = images.shape[:3]
            flat = images.permute(0, 2, 1, 3, 4).reshape(batch * frames, *images.shape[1:2], *images.shape[3:])
            per_frame = self._request_scores(
                flat, [p for p in prompts for _ in range(frames)], [r for r in records for _ in range(frames)]
            )
            # a clip's extras: the mean over its frames that have one
            self._extras = {k: torch.tensor(v).view(batch, frames).nanmean(dim=1).tolist()
                            for k, v in self._extras.items()}
            return per_frame.view(batch, frames).mean(dim=1)
        return self._request_scores(images, prompts, records)

    def _request_scores(self, images: torch.Tensor, prompts: list[str], records: list[dict[str, Any]]) -> torch.Tensor:
        chunks = [(start, min(start + self.batch_size, len(prompts))) for start in range(0, len(prompts), self.batch_size)]
        bodies = [self._body(images[a:b], prompts[a:b], records[a:b]) for a, b in chunks]
        content_type = "application/json" if self.protocol == "json" else "application/octet-stream"
        answers = self._endpoint().post_many(bodies, content_type)
        scores: list[float] = []
        extras: list[dict[str, list[float]]] = []
        for (a, b), payload in zip(chunks, answers, strict=True):
            data = self._decode(payload)
            scores.extend(parse_scores(data, b - a, self.score_keys, self._server))
            extras.append(geneval_extras(data, b - a, self._server))
        self._extras = _merge_chunks(extras, [b - a for a, b in chunks])
        return torch.tensor(scores, dtype=torch.float32)

    def take_extras(self) -> dict[str, torch.Tensor]:
        """A GenEval scorer's per-sample accuracies of the last call (:func:`geneval_extras`),
        handed over once; logged as ``reward/<name>``."""
        extras, self._extras = getattr(self, "_extras", {}), {}
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in extras.items()}

    def _body(self, images: torch.Tensor, prompts: list[str], records: list[dict[str, Any]]) -> bytes:
        pickle = self.protocol == "pickle"
        fmt = "JPEG" if pickle else "PNG"

        def encode(batch: torch.Tensor) -> list[Any]:
            raw = encode_images_bytes(batch, fmt, self.jpeg_quality)
            return raw if pickle else [base64.b64encode(r).decode("ascii") for r in raw]

        payload: dict[str, Any] = dict(self.extra_fields)
        if images.dim() == 5:  # clips: [B, 3, F, H, W] -> one list of frames per clip
            payload["videos"] = [{"frames": encode(clip.permute(1, 0, 2, 3)), "fps": self.fps} for clip in images]
        else:
            payload["images"] = encode(images)
        payload["prompts"] = list(prompts)
        if self.metadata_format == "nested":
            payload["metadata"] = {"meta_datas": records, **self.extra_fields}
            payload["meta_datas"] = records
        else:
            for key in self.metadata_keys:
                payload[key] = records
        if pickle:
            return safe_dumps(payload)
        try:
            return json.dumps(payload, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"reward 'http': the request cannot be sent as JSON ({exc}); the prompt records (metadata) must hold "
                "JSON values only, or use protocol='pickle'"
            ) from None

    def _decode(self, payload: bytes) -> Any:
        if self.protocol == "json":
            return parse_json_answer(payload, self._server)
        try:
            return safe_loads(payload)
        except UnsafePickleError as exc:
            raise malformed_response(self._server, f"{exc}; body starts with {payload[:40]!r}") from None

    def __repr__(self) -> str:
        return (
            f"HttpReward(url={self.url!r}, protocol={self.protocol!r}, batch_size={self.batch_size}, "
            f"video={self.video!r}, max_retries={self.max_retries})"
        )
