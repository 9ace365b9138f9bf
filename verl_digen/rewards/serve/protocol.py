"""The two wire protocols the reward server speaks (the ``http`` reward's,
:mod:`verl_digen.rewards.http_client`): JSON (base64 PNGs) and pickle (PNG or JPEG bytes, the
flow_grpo / veRL-Omni clients' shapes), told apart by the Content-Type (or, with none, the body's
first byte); a body in either is validated into a :class:`ScoreRequest` whose images are measured
but not yet decoded."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import numpy as np

from verl_digen.rewards.safe_pickle import UnsafePickleError, safe_loads
from verl_digen.rewards.serve.errors import RequestError
from verl_digen.rewards.serve.images import ScoreRequest, measure

SCORE_PATHS = ("/", "/score")
HEALTH_PATH = "/health"
MAX_JSON_DEPTH = 32  # the protocol needs 4 (object > videos > clip > frames); metadata gets the rest
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SIGNATURE = b"\xff\xd8\xff"
_PICKLE_TYPES = ("application/octet-stream", "application/x-pickle", "application/python-pickle")


def protocol_of(content_type: str | None) -> str | None:
    """The protocol a Content-Type names: ``pickle`` for a pickle type, else ``json``; None
    without one (the body's first byte decides then)."""
    if not content_type:
        return None
    kind = content_type.split(";")[0].strip().lower()
    if kind in _PICKLE_TYPES:
        return "pickle"
    return "json"


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
    pixels, shape = measure(items, kind, protocol, max_image_pixels)
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
