"""One stochastic (SDE) or deterministic (ODE) step of a flow-matching sampler.

Conventions (rectified flow, as in Flow-GRPO and diffusers' FlowMatchEulerDiscreteScheduler):

* ``x_sigma = (1 - sigma) * x0 + sigma * noise``; ``sigma = 1`` is pure noise, ``0`` is data;
* ``velocity = noise - x0`` (what the transformer predicts);
* one step goes from ``sigma`` to ``sigma_next < sigma``, so ``dt = sigma_next - sigma < 0``.

Every SDE step is a Gaussian transition ``x_next ~ N(mean, std^2 I)``. ``mean`` depends on the
policy (through ``velocity``); ``std`` depends only on the schedule. ``log_prob`` is the
*mean* over latent elements (not the sum) of the per-element log-density, as Flow-GRPO does,
so its clip range (around 1e-4) carries over.

All maths is done in float32 whatever the input dtype (bf16 transformers included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SDE_TYPES", "SIGMA_ONE_ATOL", "SdeStepOutput", "sde_step_with_logprob", "ode_step", "time_shift_sigmas"]

SDE_TYPES: tuple[str, ...] = ("sde", "cps", "dance_sde")

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)

# A sigma within this of 1 is the schedule's pure-noise start. Real first sigmas are 1 (flow-match
# Euler) or 1 - 1e-6 (multistep flow schedulers, float32: 0.99999899); a later sigma this close
# to 1 would mean a step of < 1e-4 from the start (shift 17 at 100 steps still gives 1 - 6e-4),
# and sigma / (1 - sigma) > 1e4 there is never a usable noise scale.
SIGMA_ONE_ATOL = 1e-4


@dataclass
class SdeStepOutput:
    """Result of one SDE step.

    Attributes:
        prev_sample: ``[B, ...]`` float32, the next (less noisy) latent ``x_{sigma_next}``.
            When sampled it is ``mean + std * noise`` (reparameterised, so it carries the graph
            of ``mean`` if grad is enabled, as in Flow-GRPO); when scored it is the input.
        log_prob: ``[B]`` float32, log-density of ``prev_sample`` under the transition, averaged
            over the non-batch dims. Differentiable w.r.t. ``velocity`` (through ``mean`` only).
        mean: ``[B, ...]`` float32, the mean of the Gaussian transition.
        std: ``[B, 1, ..., 1]`` float32 (same ndim as the sample, so it broadcasts against
            ``mean``), the standard deviation of the Gaussian transition, i.e. the factor that
            multiplies the unit noise: ``prev_sample = mean + std * noise``. For ``"sde"`` this
            is ``std_dev_t * sqrt(-dt)``, for ``"cps"`` it is ``std_dev_t``, for
            ``"dance_sde"`` it is ``noise_level * sqrt(-dt)``. Independent of the policy.
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor


def _batch_view(x: Tensor, ndim: int) -> Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` with ``ndim`` dims in total."""
    return x.reshape(x.shape[0], *([1] * (ndim - 1)))


def _check_inputs(velocity: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor) -> None:
    if sample.ndim < 1:
        raise ValueError("sample must be a [B, ...] tensor, got a 0-d tensor")
    if velocity.shape != sample.shape:
        raise ValueError(
            f"velocity shape {tuple(velocity.shape)} must equal sample shape {tuple(sample.shape)}"
        )
    batch = sample.shape[0]
    for name, s in (("sigma", sigma), ("sigma_next", sigma_next)):
        if not isinstance(s, Tensor):
            raise TypeError(f"{name} must be a [B] tensor, got {type(s).__name__}")
        if s.ndim != 1 or s.shape[0] != batch:
            raise ValueError(
                f"{name} must have shape [B]=[{batch}] matching the sample batch, "
                f"got {tuple(s.shape)}"
            )


def time_shift_sigmas(num_steps: int, shift: float) -> Tensor:
    """DanceGRPO's noise schedule (veRL-Omni's ``dance_grpo`` Wan2.2 adapters): ``[num_steps + 1]``
    float32 sigmas ``shift * t / (1 + (shift - 1) * t)`` at ``t = 1, 1 - 1/N, ..., 1/N`` (the SD3
    time shift of a uniform grid, computed in float32 as they compute it), then 0."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r} must be an integer >= 1")
    if not shift > 0:
        raise ValueError(f"shift={shift!r} must be > 0")
    import numpy as np

    # numpy's linspace (float64) cast to float32, then the shift in float32: their arithmetic
    t = torch.from_numpy(np.linspace(1.0, 0.0, num_steps + 1)).float()
    sigmas = (shift * t) / (1 + (shift - 1) * t)
    sigmas[-1] = 0.0
    return sigmas


def ode_step(velocity: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """Deterministic Euler step of the probability-flow ODE: ``x + (sigma_next - sigma) * v``.

    Args:
        velocity: ``[B, ...]`` predicted velocity (``noise - x0``).
        sample: ``[B, ...]`` current latent at noise level ``sigma``.
        sigma, sigma_next: ``[B]`` noise levels, ``sigma_next < sigma``.

    Returns:
        ``[B, ...]`` float32 latent at ``sigma_next``.
    """
    _check_inputs(velocity, sample, sigma, sigma_next)
    v, x = velocity.float(), sample.float()
    dt = _batch_view(sigma_next.float() - sigma.float(), x.ndim)
    return x + dt * v


def sde_step_with_logprob(
    velocity: Tensor,
    sample: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    *,
    noise_level: float,
    sde_type: str = "sde",
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SdeStepOutput:
    """One stochastic sampler step and the log-prob of its outcome.

    Args:
        velocity: ``[B, ...]`` predicted velocity (``noise - x0``); gradients flow from
            ``log_prob`` (and ``mean``) back to it.
        sample: ``[B, ...]`` current latent ``x_sigma``.
        sigma: ``[B]`` current noise level.
        sigma_next: ``[B]`` next noise level, ``sigma_next < sigma``.
        noise_level: the SDE's noise scale (``a`` in Flow-GRPO, ``eta`` in DanceGRPO). Must be
            ``> 0`` for ``"sde"``/``"dance_sde"`` (a Gaussian density needs ``std > 0``) and in
            ``[0, 1]`` for ``"cps"``.
        sde_type: ``"sde"`` (Flow-GRPO), ``"cps"`` (coefficients-preserving sampling) or
            ``"dance_sde"`` (DanceGRPO).
        prev_sample: ``[B, ...]`` if given, this outcome is *scored*: no noise is drawn, the
            generator is not touched, and it is returned (as float32) as ``prev_sample``.
        generator: RNG for the unit Gaussian noise (``torch.randn`` in float32 on the sample's
            device) when sampling.

    Returns:
        :class:`SdeStepOutput` (``prev_sample`` and ``mean`` ``[B, ...]``, ``log_prob`` ``[B]``,
        ``std`` ``[B, 1, ..., 1]``), all float32.

    The log-density is evaluated at ``prev_sample.detach()``, so the gradient of ``log_prob``
    flows only through ``mean`` (the policy), as in Flow-GRPO.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}; valid values are {SDE_TYPES}")
    _check_inputs(velocity, sample, sigma, sigma_next)
    noise_level = float(noise_level)
    if sde_type == "cps":
        if not 0.0 <= noise_level <= 1.0:
            raise ValueError(f"noise_level={noise_level} must be in [0, 1] for sde_type 'cps'")
    elif not noise_level > 0.0:
        raise ValueError(f"noise_level={noise_level} must be > 0 for sde_type {sde_type!r}")
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample shape {tuple(prev_sample.shape)} must equal sample shape "
            f"{tuple(sample.shape)}"
        )

    v, x = velocity.float(), sample.float()
    nd = x.ndim
    s = _batch_view(sigma.float(), nd)
    s_next = _batch_view(sigma_next.float(), nd)
    dt = s_next - s  # < 0

    if sde_type == "sde":
        # At sigma = 1 the SDE coefficient sigma / (1 - sigma) is infinite; Flow-GRPO puts
        # sigmas[1] (the first step's sigma_next) in the denominator. Schedules that start just
        # below 1 (diffusers' multistep flow schedulers, Wan2.1's UniPC: 1 - 1e-6) need the same
        # treatment, or the first step's noise is ~100x the intended one.
        s_safe = torch.where(s > 1 - SIGMA_ONE_ATOL, s_next, s)
        std_dev_t = torch.sqrt(s / (1 - s_safe)) * noise_level
        var_t = std_dev_t**2
        mean = x * (1 + var_t / (2 * s) * dt) + v * (1 + var_t * (1 - s) / (2 * s)) * dt
        std = std_dev_t * torch.sqrt(-dt)
    elif sde_type == "cps":
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0_pred = x - s * v
        noise_pred = x + (1 - s) * v
        # clamp: s_next^2 - std^2 = (s_next cos)^2 >= 0 can round to -0.0...1 at noise_level=1
        mean = x0_pred * (1 - s_next) + noise_pred * torch.sqrt((s_next**2 - std**2).clamp_min(0))
    else:  # dance_sde
        x0_pred = x - s * v
        score = -(x - (1 - s) * x0_pred) / s**2
        mean = x + dt * v - 0.5 * noise_level**2 * score * dt
        std = noise_level * torch.sqrt(-dt)

    if prev_sample is None:
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=x.device)
        prev_sample = mean + std * noise
    else:
        prev_sample = prev_sample.float()

    diff = prev_sample.detach() - mean
    if sde_type == "cps":
        # CPS: an unnormalised score, -(x - mean)^2, which is what Flow-GRPO optimises.
        log_prob = -(diff**2)
    else:
        log_prob = -(diff**2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    log_prob = log_prob.mean(dim=tuple(range(1, nd))) if nd > 1 else log_prob
    return SdeStepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)
