"""Sampling groups of SDE trajectories with behaviour log-probs (the rollout's maths).

A *group* is G images of one prompt. Each group's randomness comes from its own generator,
seeded from ``(seed, group_id)``, so a group is the same trajectory whichever worker
samples it, in whatever order: this is what makes GAP, TSP and TAG exact.

The record of a trajectory (what the trainer needs to recompute each trained step):

- ``latents``   ``[B, S+1, *latent]``  x_0 (noise) ... x_S, model space, fp32
- ``log_probs`` ``[B, S]``             behaviour log-prob of each SDE step (0 for ODE steps)
- ``sigmas``    ``[B, S+1]``           noise levels
- ``sde_mask``  ``[B, S]``             steps inside the SDE window (stochastic, log-prob recorded)
- ``train_mask`` ``[B, S]``            steps that are trained (SDE window, subsampled)
- ``images``    ``[B, 3, H, W]``       decoded pixels in [0, 1] (video: ``[B, 3, F, H, W]``)
- ``cond__<k>`` / ``neg__<k>``         conditioning (and CFG negative) tensors
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl import DataProto
from verl_digen.algos.sde import ode_step, sde_step_with_logprob
from verl_digen.algos.window import SdeWindowConfig, select_sde_window, subsample_timesteps
from verl_digen.models.base import Conditioning, DiffusionAdapter, SampleSpec

COND_PREFIX = "cond__"
NEG_PREFIX = "neg__"


@dataclass(frozen=True)
class SamplingSettings:
    spec: SampleSpec
    num_steps: int
    noise_level: float
    sde_type: str
    window: SdeWindowConfig
    timestep_fraction: float
    negative_prompt: str = ""
    autocast_bf16: bool = False

    @property
    def uses_cfg(self) -> bool:
        return self.spec.guidance_scale > 1.0


def group_seed(seed: int, group_id: int) -> int:
    return (seed * 1_000_003 + group_id * 7919 + 17) % (2**63 - 1)


def step_plan(settings: SamplingSettings, *, training_step: int, seed: int) -> tuple[list[int], list[int]]:
    """The SDE window of a training step and the steps trained inside it (same for all groups)."""
    window = select_sde_window(settings.num_steps, settings.window, training_step=training_step, seed=seed)
    gen = torch.Generator().manual_seed(group_seed(seed, -1 - training_step))
    trained = subsample_timesteps(window, settings.timestep_fraction, generator=gen)
    return window, trained


def autocast_context(device: torch.device, enabled: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def _cat_cond(items: list[Conditioning]) -> Conditioning:
    return {k: torch.cat([c[k] for c in items], dim=0) for k in items[0]}


def _repeat_cond(cond: Conditioning, n: int) -> Conditioning:
    return {k: v.repeat_interleave(n, dim=0) for k, v in cond.items()}


@torch.no_grad()
def sample_groups(
    adapter: DiffusionAdapter,
    prompts: list[str],
    group_ids: list[int],
    prompt_indices: list[int],
    *,
    group_size: int,
    settings: SamplingSettings,
    training_step: int,
    seed: int,
    policy_version: int,
) -> DataProto:
    """Sample ``group_size`` trajectories for each prompt; returns a DataProto of ``len(prompts) * G`` rows."""
    device = adapter.device
    spec = settings.spec
    window, trained = step_plan(settings, training_step=training_step, seed=seed)
    window_set = set(window)

    cond = _repeat_cond(adapter.encode_prompts(prompts), group_size)  # [B, ...]
    neg = None
    if settings.uses_cfg:
        neg = _repeat_cond(adapter.encode_prompts([settings.negative_prompt] * len(prompts)), group_size)

    generators = [torch.Generator().manual_seed(group_seed(seed, g)) for g in group_ids]
    x = torch.cat([adapter.prepare_latents(group_size, spec, gen) for gen in generators], dim=0).to(device)
    batch = x.shape[0]
    sigmas = adapter.sigmas(settings.num_steps, spec).to(device=device, dtype=torch.float32)  # [S+1]

    latents = [x]
    log_probs = torch.zeros(batch, settings.num_steps, dtype=torch.float32, device=device)
    for i in range(settings.num_steps):
        sigma = sigmas[i].expand(batch)
        sigma_next = sigmas[i + 1].expand(batch)
        with autocast_context(device, settings.autocast_bf16):
            v = adapter.predict_velocity(x, sigma, cond, spec, negative_cond=neg)
        v = v.float()
        if i in window_set:
            # Each group draws its step noise from its own generator: identical wherever it runs.
            noise = torch.cat(
                [torch.randn((group_size, *x.shape[1:]), generator=gen, dtype=torch.float32) for gen in generators]
            ).to(device)
            out = _sde_with_noise(v, x, sigma, sigma_next, noise, settings)
            x = out.prev_sample
            log_probs[:, i] = out.log_prob
        else:
            x = ode_step(v, x, sigma, sigma_next)
        latents.append(x)

    images = adapter.decode(x, spec).float().clamp(0, 1)
    train_mask = torch.zeros(batch, settings.num_steps, dtype=torch.bool, device=device)
    train_mask[:, trained] = True
    sde_mask = torch.zeros_like(train_mask)
    sde_mask[:, window] = True
    tensors = {
        "latents": torch.stack(latents, dim=1).cpu(),
        "log_probs": log_probs.cpu(),
        "sigmas": sigmas.unsqueeze(0).expand(batch, -1).contiguous().cpu(),
        "train_mask": train_mask.cpu(),
        "sde_mask": sde_mask.cpu(),
        "images": images.cpu(),
    }
    tensors.update({COND_PREFIX + k: v.cpu() for k, v in cond.items()})
    if neg is not None:
        tensors.update({NEG_PREFIX + k: v.cpu() for k, v in neg.items()})
    non_tensors = {
        "prompt": np.array([p for p in prompts for _ in range(group_size)], dtype=object),
        "group_id": np.array([g for g in group_ids for _ in range(group_size)], dtype=np.int64),
        "prompt_index": np.array([p for p in prompt_indices for _ in range(group_size)], dtype=np.int64),
        "policy_version": np.full(batch, policy_version, dtype=np.int64),
    }
    return DataProto.from_dict(
        tensors=tensors,
        non_tensors=non_tensors,
        meta_info={"training_step": training_step, "policy_version": policy_version, "window": window},
    )


def _sde_with_noise(v, x, sigma, sigma_next, noise, settings: SamplingSettings):
    """One SDE step whose Gaussian noise is given (drawn per group by the caller).

    ``sde_step_with_logprob`` draws from one generator for the whole batch; groups need
    their own streams, so we compute the mean/std by scoring a dummy and then form the
    sample from the caller's noise and score it.
    """
    probe = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=settings.noise_level, sde_type=settings.sde_type, prev_sample=x
    )
    prev = probe.mean + probe.std * noise
    return sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=settings.noise_level, sde_type=settings.sde_type, prev_sample=prev
    )


def conditioning_from(data: DataProto) -> tuple[Conditioning, Conditioning | None]:
    cond = {k[len(COND_PREFIX):]: v for k, v in data.batch.items() if k.startswith(COND_PREFIX)}
    neg = {k[len(NEG_PREFIX):]: v for k, v in data.batch.items() if k.startswith(NEG_PREFIX)}
    return cond, (neg or None)
