"""Group-normalised advantages (GRPO), as Flow-GRPO computes them.

For a sample ``i`` in group ``g`` (the G images of one prompt):

    A_i = (r_i - mean_g(r)) / (std + eps)

with ``std`` the *population* standard deviation (``numpy.std``, i.e. ``unbiased=False``,
what Flow-GRPO's ``PerPromptStatTracker`` uses) of the group (``std_mode="group"``), of the
whole batch (``"global"``, Flow-GRPO's ``global_std``) or ``1`` (``"none"``: centring only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["STD_MODES", "GroupAdvantageConfig", "group_advantages"]

STD_MODES: tuple[str, ...] = ("group", "global", "none")


@dataclass
class GroupAdvantageConfig:
    """Options of :func:`group_advantages`.

    Attributes:
        std_mode: ``"group"`` | ``"global"`` | ``"none"``.
        eps: added to the std before dividing (Flow-GRPO: 1e-4).
        clip: if set, advantages are clamped to ``[-clip, clip]``.
    """

    std_mode: str = "group"
    eps: float = 1e-4
    clip: float | None = None

    def validate(self) -> None:
        if self.std_mode not in STD_MODES:
            raise ValueError(
                f"advantage std_mode={self.std_mode!r} is not valid; choose one of {STD_MODES}"
            )
        if not self.eps >= 0:
            raise ValueError(f"advantage eps={self.eps} must be >= 0")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"advantage clip={self.clip} must be > 0 or None")

    def __call__(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """``group_advantages(rewards, group_ids, **self)``."""
        return group_advantages(
            rewards, group_ids, std_mode=self.std_mode, eps=self.eps, clip=self.clip
        )


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_mode: str = "group",
    eps: float = 1e-4,
    clip: float | None = None,
) -> Tensor:
    """Normalise rewards within their groups.

    Args:
        rewards: ``[N]`` rewards (any real dtype; all must be finite).
        group_ids: ``[N]`` integer group labels (any values, need not be contiguous or sorted).
            Every group must have at least 2 members.
        std_mode: ``"group"`` (per-group std), ``"global"`` (std over all N rewards) or
            ``"none"`` (divide by 1: only subtract the group mean). Stds are population stds
            (``unbiased=False``), as ``numpy.std`` in Flow-GRPO.
        eps: added to the std (not used with ``"none"``).
        clip: if given, clamp the result to ``[-clip, clip]``.

    Returns:
        ``[N]`` advantages, in the rewards' floating dtype (float32 for integer rewards).
        Computed in float64.
    """
    GroupAdvantageConfig(std_mode=std_mode, eps=eps, clip=clip).validate()
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be a 1-d [N] tensor, got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids shape {tuple(group_ids.shape)} must equal rewards shape "
            f"{tuple(rewards.shape)}"
        )
    gdt = group_ids.dtype
    if gdt.is_floating_point or gdt.is_complex or gdt == torch.bool:
        raise ValueError(f"group_ids must be an integer (long) tensor, got dtype {group_ids.dtype}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty; there is nothing to normalise")
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards must be finite; non-finite values at indices {bad}")

    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    r = rewards.to(torch.float64)
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(inv, minlength=uniq.numel())
    if bool((counts < 2).any()):
        singles = uniq[counts < 2].tolist()
        raise ValueError(
            f"group size must be >= 2 for group-normalised advantages; groups {singles} have "
            f"a single sample"
        )
    cnt = counts.to(torch.float64)
    group_mean = torch.zeros_like(cnt).index_add_(0, inv, r) / cnt
    centred = r - group_mean[inv]
    if std_mode == "group":
        group_var = torch.zeros_like(cnt).index_add_(0, inv, centred**2) / cnt
        adv = centred / (group_var.sqrt()[inv] + eps)
    elif std_mode == "global":
        adv = centred / (r.std(correction=0) + eps)
    else:
        adv = centred
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.to(out_dtype)
