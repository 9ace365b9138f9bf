"""Group-normalised advantages (GRPO), as Flow-GRPO computes them.

For a sample ``i`` in group ``g`` (the G images of one prompt):

    A_i = (r_i - mean_g(r)) / (std + eps)

with ``std`` the standard deviation of the group (``std_mode="group"``), of the whole batch
(``"global"``, Flow-GRPO's and veRL-Omni's ``global_std``) or ``1`` (``"none"``: centring only).

The std over ``n`` rewards is ``sqrt(sum((r - mean)^2) / (n - correction))``:

* ``correction=0``: the *population* std (``numpy.std``, what Flow-GRPO's ``PerPromptStatTracker``
  uses);
* ``correction=1/T``: veRL-Omni's. Its ``compute_flow_grpo_outcome_advantage`` repeats each
  reward once per recorded SDE step (``[n, T]``, ``T = old_log_probs.shape[1]``) and takes
  ``torch.std`` (Bessel-corrected) of that: ``T * sum((r - mean)^2) / (n*T - 1)``, which is the
  formula above with ``correction = 1/T``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["STD_ESTIMATORS", "STD_MODES", "GroupAdvantageConfig", "group_advantages", "run_std_correction",
           "std_correction"]

STD_MODES: tuple[str, ...] = ("group", "global", "none")
STD_ESTIMATORS: tuple[str, ...] = ("population", "verl_omni")


def std_correction(estimator: str, recorded_steps: int) -> float:
    """The ``correction`` of :func:`group_advantages` for ``digen.algo.std_estimator``:
    ``population`` 0 (Flow-GRPO's ``numpy.std``), ``verl_omni`` ``1 / recorded_steps`` (veRL-Omni's
    ``torch.std`` of the rewards repeated over the ``recorded_steps`` SDE steps of a trajectory)."""
    if estimator not in STD_ESTIMATORS:
        raise ValueError(f"std_estimator={estimator!r} is not valid; choose one of {STD_ESTIMATORS}")
    if estimator == "population":
        return 0.0
    if not isinstance(recorded_steps, int) or recorded_steps < 1:
        raise ValueError(f"recorded_steps={recorded_steps!r} must be an integer >= 1")
    return 1.0 / recorded_steps


def run_std_correction(cfg: Any) -> float:
    """:func:`std_correction` of a run's ``DigenConfig``: its ``algo.std_estimator`` over the SDE
    steps a trajectory records (the window's length, the same every training step)."""
    from verl_digen.algos.window import select_sde_window

    s = cfg.sampling
    steps = len(select_sde_window(s.num_steps, s.sde_window, training_step=0, seed=0))
    return std_correction(cfg.algo.std_estimator, steps)


@dataclass
class GroupAdvantageConfig:
    """Options of :func:`group_advantages`.

    Attributes:
        std_mode: ``"group"`` | ``"global"`` | ``"none"``.
        eps: added to the std before dividing (Flow-GRPO: 1e-4).
        clip: if set, advantages are clamped to ``[-clip, clip]``.
        correction: the std's divisor is ``n - correction`` (0: population std, Flow-GRPO's;
            ``1/T``: veRL-Omni's, see the module docstring). In ``[0, 1]``.
    """

    std_mode: str = "group"
    eps: float = 1e-4
    clip: float | None = None
    correction: float = 0.0

    def validate(self) -> None:
        if self.std_mode not in STD_MODES:
            raise ValueError(
                f"advantage std_mode={self.std_mode!r} is not valid; choose one of {STD_MODES}"
            )
        if not self.eps >= 0:
            raise ValueError(f"advantage eps={self.eps} must be >= 0")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"advantage clip={self.clip} must be > 0 or None")
        if not 0.0 <= self.correction <= 1.0:
            raise ValueError(f"advantage std correction={self.correction} must be in [0, 1]")

    def __call__(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """``group_advantages(rewards, group_ids, **self)``."""
        return group_advantages(
            rewards, group_ids, std_mode=self.std_mode, eps=self.eps, clip=self.clip,
            correction=self.correction,
        )


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_mode: str = "group",
    eps: float = 1e-4,
    clip: float | None = None,
    correction: float = 0.0,
) -> Tensor:
    """Normalise rewards within their groups.

    Args:
        rewards: ``[N]`` rewards (any real dtype; all must be finite).
        group_ids: ``[N]`` integer group labels (any values, need not be contiguous or sorted).
            Every group must have at least 2 members.
        std_mode: ``"group"`` (per-group std), ``"global"`` (std over all N rewards) or
            ``"none"`` (divide by 1: only subtract the group mean).
        eps: added to the std (not used with ``"none"``).
        clip: if given, clamp the result to ``[-clip, clip]``.
        correction: the std of ``n`` rewards divides their squared deviations by
            ``n - correction``: 0 (default) is the population std, as ``numpy.std`` in Flow-GRPO;
            ``1/T`` is veRL-Omni's (each reward repeated over its ``T`` recorded SDE steps).

    Returns:
        ``[N]`` advantages, in the rewards' floating dtype (float32 for integer rewards).
        Computed in float64.
    """
    GroupAdvantageConfig(std_mode=std_mode, eps=eps, clip=clip, correction=correction).validate()
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
        group_var = torch.zeros_like(cnt).index_add_(0, inv, centred**2) / (cnt - correction)
        adv = centred / (group_var.sqrt()[inv] + eps)
    elif std_mode == "global":
        global_var = ((r - r.mean()) ** 2).sum() / (r.numel() - correction)
        adv = centred / (global_var.sqrt() + eps)
    else:
        adv = centred
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.to(out_dtype)
