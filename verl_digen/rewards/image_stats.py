"""Weight-free image statistics used as toy rewards: brightness and colourfulness."""

from __future__ import annotations

import torch

from verl_digen.rewards.base import RewardFn, register_reward

__all__ = ["BrightnessReward", "ColorfulnessReward", "colorfulness"]


@register_reward("brightness")
class BrightnessReward(RewardFn):
    """Mean pixel value over channels and pixels, in ``[0, 1]``."""

    reads_prompts = False

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return images.float().mean(dim=(1, 2, 3))


def colorfulness(images: torch.Tensor) -> torch.Tensor:
    """Hasler & Süsstrunk (2003) colourfulness of ``[N, 3, H, W]`` RGB images in ``[0, 1]``.

    With opponent channels ``rg = R - G`` and ``yb = (R + G) / 2 - B``::

        M = sqrt(std(rg)^2 + std(yb)^2) + 0.3 * sqrt(mean(rg)^2 + mean(yb)^2)

    (population std over the pixels of each image). The paper computes ``M`` on 0..255
    pixels; here pixels are in ``[0, 1]``, so the value is the paper's divided by 255.
    Grey images score 0; the paper's "extremely colourful" threshold (109) becomes ~0.43;
    the maximum possible value is about 1.2 (saturated complementary colours), so the
    metric lies in roughly ``[0, 1]``.
    """
    images = images.float()
    red, green, blue = images[:, 0], images[:, 1], images[:, 2]
    rg = (red - green).flatten(1)
    yb = (0.5 * (red + green) - blue).flatten(1)
    std_term = torch.sqrt(rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False))
    mean_term = torch.sqrt(rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2)
    return std_term + 0.3 * mean_term


@register_reward("colorfulness")
class ColorfulnessReward(RewardFn):
    """Hasler–Süsstrunk colourfulness on ``[0, 1]`` pixels (see :func:`colorfulness`)."""

    reads_prompts = False

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return colorfulness(images)
