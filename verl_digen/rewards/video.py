"""Weight-free video rewards: temporal smoothness."""

from __future__ import annotations

import torch

from verl_digen.rewards.base import RewardFn, register_reward

__all__ = ["TemporalSmoothnessReward", "temporal_smoothness"]


def temporal_smoothness(videos: torch.Tensor) -> torch.Tensor:
    """Negative mean squared difference between consecutive frames of ``[B, 3, F, H, W]`` videos.

    ``-mean((x[:, :, t+1] - x[:, :, t])^2)`` over channels, the ``F - 1`` frame pairs and
    pixels, one value per video: 0 for a still video, at least -1 for pixels in ``[0, 1]``. A
    single-frame video scores 0 (nothing moves).
    """
    videos = videos.float()
    if videos.shape[2] < 2:
        return videos.new_zeros(videos.shape[0])
    diff = videos[:, :, 1:] - videos[:, :, :-1]  # [B, 3, F-1, H, W]
    return -diff.square().mean(dim=(1, 2, 3, 4))


@register_reward("temporal_smoothness")
class TemporalSmoothnessReward(RewardFn):
    """Rewards videos whose frames change little: see :func:`temporal_smoothness`. Video only."""

    supports_video = True
    reads_prompts = False

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if images.dim() != 5:
            raise ValueError(
                f"reward {self.name!r} scores videos [B, 3, F, H, W]; got images of shape {tuple(images.shape)} "
                "(use a video model, i.e. sampling.num_frames > 1, or an image reward)"
            )
        return temporal_smoothness(images)
