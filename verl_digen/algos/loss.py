"""FlowGRPO policy loss: PPO clipped surrogate on per-step log-probs, plus an optional KL.

For one recorded SDE step of a batch of B trajectories::

    A     = clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = exp(log_prob - old_log_prob)
    policy_loss = mean_B( max(-A * ratio, -A * clamp(ratio, 1 - clip_range, 1 + clip_range)) )
    kl_loss     = mean_B( gaussian_kl(mean, ref_mean, std) )
    loss        = policy_loss + kl_beta * kl_loss

Loss scale. ``loss`` is a *mean* over the B samples it is given. A caller that splits a batch
of ``batch_size`` samples into micro-batches and accumulates gradients must multiply each
micro-batch's loss by ``micro_batch_size / batch_size`` itself, so that the accumulated
gradient equals the gradient of the full-batch mean (this is what makes gradient accumulation
order-independent, e.g. for GAP). Summing over the trained time steps is likewise the caller's
job (Flow-GRPO steps the optimizer after accumulating over the steps; dividing by the number of
trained steps gives its per-step mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PolicyLossOutput", "flow_grpo_loss", "gaussian_kl"]


@dataclass
class PolicyLossOutput:
    """Result of :func:`flow_grpo_loss`.

    Attributes:
        loss: scalar, differentiable: ``policy_loss + kl_beta * kl_loss``.
        policy_loss: scalar, detached: the clipped surrogate.
        kl_loss: scalar, detached: the mean Gaussian KL to the reference (0 when not computed).
        clip_frac: scalar, detached: fraction of samples with ``|ratio - 1| > clip_range``.
        approx_kl: scalar, detached: ``0.5 * mean((log_prob - old_log_prob)^2)``.
        ratio_mean: scalar, detached: mean importance ratio.
    """

    loss: Tensor
    policy_loss: Tensor
    kl_loss: Tensor
    clip_frac: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor


def gaussian_kl(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """KL between two Gaussians of equal isotropic std, averaged over latent elements.

    ``KL(N(mean, std^2) || N(ref_mean, std^2)) = (mean - ref_mean)^2 / (2 std^2)`` per element.

    Args:
        mean: ``[B, ...]`` policy transition mean.
        ref_mean: ``[B, ...]`` reference transition mean.
        std: ``[B]``, ``[B, 1, ..., 1]`` or anything broadcastable to ``mean``; must be > 0.

    Returns:
        ``[B]`` float32, the per-element KL averaged over the non-batch dims.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"mean shape {tuple(mean.shape)} must equal ref_mean shape {tuple(ref_mean.shape)}"
        )
    if mean.ndim < 1:
        raise ValueError("mean must be a [B, ...] tensor, got a 0-d tensor")
    std = std.float()
    if std.ndim == 1 and mean.ndim > 1 and std.shape[0] == mean.shape[0]:
        std = std.reshape(std.shape[0], *([1] * (mean.ndim - 1)))
    kl = (mean.float() - ref_mean.float()) ** 2 / (2 * std**2)
    return kl.mean(dim=tuple(range(1, kl.ndim))) if kl.ndim > 1 else kl


def _check_per_sample(name: str, t: Tensor, batch: int) -> None:
    if t.ndim != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B]=[{batch}], got {tuple(t.shape)}")


def flow_grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    adv_clip_max: float = 5.0,
    kl_beta: float = 0.0,
    mean: Tensor | None = None,
    ref_mean: Tensor | None = None,
    std: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate of FlowGRPO for one SDE step (see the module docstring).

    Args:
        log_prob: ``[B]`` log-prob under the current policy (differentiable).
        old_log_prob: ``[B]`` behaviour-policy log-prob recorded at rollout (detached here).
        advantages: ``[B]`` group-normalised advantages (detached here).
        clip_range: PPO epsilon, > 0 (Flow-GRPO uses about 1e-4).
        adv_clip_max: advantages are clamped to ``[-adv_clip_max, adv_clip_max]``, > 0.
        kl_beta: weight of the KL to the reference, >= 0. When > 0, ``mean``, ``ref_mean`` and
            ``std`` are required.
        mean: ``[B, ...]`` current policy transition mean (differentiable).
        ref_mean: ``[B, ...]`` frozen reference transition mean (detached here).
        std: ``[B]`` or ``[B, 1, ...]`` transition std (detached here; it does not depend on
            the policy).

    When ``mean``, ``ref_mean`` and ``std`` are all given the KL is also reported with
    ``kl_beta == 0`` (as a metric; it then adds nothing to ``loss``).

    Returns:
        :class:`PolicyLossOutput`; ``loss`` is the batch mean (see "Loss scale" above).
    """
    if not clip_range > 0:
        raise ValueError(f"clip_range={clip_range} must be > 0")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max={adv_clip_max} must be > 0")
    if not kl_beta >= 0:
        raise ValueError(f"kl_beta={kl_beta} must be >= 0")
    if log_prob.ndim != 1:
        raise ValueError(f"log_prob must have shape [B], got {tuple(log_prob.shape)}")
    batch = log_prob.shape[0]
    _check_per_sample("old_log_prob", old_log_prob, batch)
    _check_per_sample("advantages", advantages, batch)
    kl_inputs = {"mean": mean, "ref_mean": ref_mean, "std": std}
    missing = [k for k, v in kl_inputs.items() if v is None]
    if kl_beta > 0 and missing:
        raise ValueError(f"kl_beta={kl_beta} > 0 needs mean, ref_mean and std; missing {missing}")

    log_prob = log_prob.float()
    adv = advantages.detach().float().clamp(-adv_clip_max, adv_clip_max)
    log_ratio = log_prob - old_log_prob.detach().float()
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()

    if not missing:
        if mean.shape[0] != batch:
            raise ValueError(f"mean batch size {mean.shape[0]} must equal log_prob's {batch}")
        kl_loss = gaussian_kl(mean, ref_mean.detach(), std.detach()).mean()
    else:
        kl_loss = policy_loss.new_zeros(())
    loss = policy_loss + kl_beta * kl_loss if kl_beta > 0 else policy_loss

    with torch.no_grad():
        clip_frac = ((ratio - 1.0).abs() > clip_range).float().mean()
        approx_kl = 0.5 * (log_ratio**2).mean()
        ratio_mean = ratio.mean()
    return PolicyLossOutput(
        loss=loss,
        policy_loss=policy_loss.detach(),
        kl_loss=kl_loss.detach(),
        clip_frac=clip_frac,
        approx_kl=approx_kl,
        ratio_mean=ratio_mean,
    )
