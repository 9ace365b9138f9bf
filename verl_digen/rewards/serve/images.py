"""The images of a scoring request: measured from their headers (no decompression), decoded
straight into one uint8 ``[N, F, H, W, 3]`` array, and converted to float32 for the reward."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from verl_digen.rewards.serve.errors import RequestError


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


def _formats(protocol: str) -> list[str]:
    return ["PNG"] if protocol == "json" else ["PNG", "JPEG"]


def _name(kind: str, index: int, frame: int) -> str:
    return f"image {index}" if kind == "images" else f"video {index} frame {frame}"


def measure(
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
