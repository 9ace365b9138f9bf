"""JPEG (in)compressibility rewards, as in DDPO (Black et al., 2023).

Each image is quantised to 8 bits, encoded to JPEG in memory with PIL and measured in
kilobytes (``bytes / 1000``). ``jpeg_compressibility`` is ``-size_kb / 500`` (smaller files score
higher), ``jpeg_incompressibility`` is ``+size_kb``: Flow-GRPO's rewards of these names, value for
value (its ``jpeg_compressibility`` divides by 500, its ``jpeg_incompressibility`` does not), so
a port of a Flow-GRPO config learns on the same numbers.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from verl_digen.rewards.base import RewardFn, register_reward

__all__ = ["JpegCompressibilityReward", "JpegIncompressibilityReward", "jpeg_size_kb", "to_uint8_hwc"]


def to_uint8_hwc(images: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` floats in ``[0, 1]`` -> ``[N, H, W, 3]`` uint8 on the CPU (rounded, clamped)."""
    return (images.detach().float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def jpeg_size_kb(images: torch.Tensor, quality: int = 95, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """JPEG-encoded size in kB (``bytes / 1000``) of each ``[N, 3, H, W]`` image; ``[N]`` of ``dtype``."""
    sizes = []
    for array in to_uint8_hwc(images).numpy():
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=dtype)


class _JpegSizeReward(RewardFn):
    sign: float = 1.0  # the score is sign * size_kb / divisor
    divisor: float = 1.0
    reads_prompts = False

    def __init__(self, quality: int = 95) -> None:
        if not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ValueError(f"reward {self.name!r}: quality must be an int in [1, 100], got {quality!r}")
        self.quality = quality

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        # in float64, then float32: Flow-GRPO's NumPy arithmetic, to the bit
        return (self.sign * jpeg_size_kb(images, self.quality, torch.float64) / self.divisor).float()


@register_reward("jpeg_compressibility")
class JpegCompressibilityReward(_JpegSizeReward):
    """``-size_kb / 500`` of the JPEG-encoded image (quality 95 by default): Flow-GRPO's value."""

    sign, divisor = -1.0, 500.0


@register_reward("jpeg_incompressibility")
class JpegIncompressibilityReward(_JpegSizeReward):
    """``+size_kb`` of the JPEG-encoded image (quality 95 by default)."""

    sign = 1.0
