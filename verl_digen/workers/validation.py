"""Validation on a worker: deterministic sampling of fixed prompts, scoring, image grids.

Validation must measure the *policy*, not the sampler's luck, so it samples with the rollout
sampler in its ODE mode (``begin_groups(..., ode=True)``: an Euler
:func:`~verl_digen.algos.sde.ode_step` at every step, no SDE noise) from initial noise that
depends only on ``(seed, prompt index)``: the same weights, prompts, settings and seed give
bitwise the same images, every validation step, whichever worker runs it. Prompt ``i`` is the
one-image group ``VALIDATION_GROUP_OFFSET + i``, so its noise comes from
``torch.Generator().manual_seed(group_seed(seed, 10_000_000 + i))``, an id range training
groups never use: validation noise never repeats a training group's noise.

Everything here is plain torch / numpy / PIL (no Ray): a worker calls :func:`run_validation`
on its own adapter and ships back the :class:`ValidationResult`; the controller logs the grid to
TensorBoard / wandb (its ``media`` module).

Video (``[N, 3, F, H, W]``): :func:`image_grid` shows the *middle frame* ``F // 2`` of each
video (one cell per video); :func:`save_video_gif` writes a whole clip as an animated GIF.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from verl_digen.models.base import DiffusionAdapter
from verl_digen.workers.sampling import (
    GroupRequest,
    SamplingSettings,
    begin_groups,
    decode_groups,
    denoise,
    group_seed,
)

__all__ = [
    "VALIDATION_GROUP_OFFSET",
    "MAX_VIDEO_GIFS",
    "validation_seed",
    "sample_deterministic",
    "image_grid",
    "to_uint8",
    "save_grid_png",
    "save_video_gif",
    "ValidationResult",
    "run_validation",
]

#: Validation prompt ``i`` uses group id ``VALIDATION_GROUP_OFFSET + i`` for its noise seed.
VALIDATION_GROUP_OFFSET = 10_000_000
#: :func:`run_validation` writes a GIF for at most this many videos.
MAX_VIDEO_GIFS = 4


def validation_seed(seed: int, index: int) -> int:
    """Seed of validation prompt ``index``'s initial noise (disjoint from training group ids)."""
    return group_seed(seed, VALIDATION_GROUP_OFFSET + index)


@contextmanager
def _eval_mode(module: torch.nn.Module):
    """Put ``module`` in eval mode for the duration (dropout off), restoring its mode after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


@torch.no_grad()
def sample_deterministic(
    adapter: DiffusionAdapter,
    prompts: list[str],
    settings: SamplingSettings,
    *,
    seed: int,
    batch_size: int | None = None,
    records: Sequence[Mapping[str, Any]] | None = None,
    latents_out: list[dict[str, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """One image per prompt with the rollout sampler's deterministic ODE mode (validation / evaluation).
    ``records``: each prompt's record (its own CFG ``negative_prompt``, when it has one).

    Every step is an Euler ODE step (``settings.noise_level``, ``sde_type`` and ``window`` are
    ignored); CFG (``settings.spec.guidance_scale`` with ``settings.negative_prompt``, encoded
    once) and the run's dtype are applied as in training rollouts. Prompt ``i``'s initial noise
    comes from ``adapter.prepare_latents(1, settings.spec, Generator().manual_seed(validation_seed(seed, i)))``.
    The denoiser runs in eval mode (its previous mode is restored).

    Args:
        adapter: the model.
        prompts: ``N`` prompts.
        settings: sampling settings (spec, number of steps, CFG).
        seed: validation seed.
        batch_size: prompts per forward (``None``: all at once). Results are deterministic for
            a fixed ``batch_size``; different batch sizes may differ in the last float bits.

    Returns:
        ``[N, 3, H, W]`` (video: ``[N, 3, F, H, W]``) float32 CPU images in ``[0, 1]``.
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError("sample_deterministic needs at least one prompt")
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be a list of strings")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    n = len(prompts)
    chunk = n if batch_size is None else batch_size
    out: list[torch.Tensor] = []
    with _eval_mode(adapter.transformer):
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            indices = list(range(start, end))
            groups = [VALIDATION_GROUP_OFFSET + i for i in indices]  # noise seeds: validation_seed(seed, i)
            request = GroupRequest(prompts[start:end], groups, indices, group_size=1, training_step=0, seed=seed,
                                   policy_version=0,  # training_step / policy_version: unused by ODE sampling
                                   metadata=list(records[start:end]) if records is not None else None)
            state = begin_groups(adapter, request, settings, ode=True)
            denoise(adapter, state, settings, settings.num_steps)
            if latents_out is not None:  # a reward that reads latents: each chunk's final latents and conditioning
                latents_out.append({"latents_clean": state.newest.detach().float().cpu(),
                                    **{k: v.detach().cpu() for k, v in state.cond.items()}})
            out.append(decode_groups(adapter, state, settings))
    return torch.cat(out, dim=0)


# ----------------------------------------------------------------------------- images


def to_uint8(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """``[..., 3, H, W]`` floats in ``[0, 1]`` -> ``[..., H, W, 3]`` uint8 (rounded, clipped)."""
    if isinstance(images, torch.Tensor):
        images = images.detach().float().cpu().numpy()
    arr = np.asarray(images, dtype=np.float32)
    arr = np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8)
    return np.moveaxis(arr, -3, -1)


def _check_images(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.dim() not in (4, 5) or images.shape[1] != 3 or images.shape[0] < 1:
        raise ValueError(f"images must be [N, 3, H, W] or [N, 3, F, H, W] with N >= 1, got {tuple(images.shape)}")


def image_grid(images: torch.Tensor, nrow: int | None = None, *, padding: int = 2, pad_value: int = 0) -> np.ndarray:
    """Tile images into one ``uint8`` ``[H_grid, W_grid, 3]`` array.

    Args:
        images: ``[N, 3, H, W]`` in ``[0, 1]``; for video ``[N, 3, F, H, W]`` the middle frame
            (index ``F // 2``) of each clip is shown.
        nrow: images per row (torchvision's convention); ``None``: ``ceil(sqrt(N))``.
        padding: pixels of ``pad_value`` around and between cells (torchvision layout).

    The grid has ``rows = ceil(N / nrow)`` rows and ``cols = min(nrow, N)`` columns, so it is
    ``rows * (H + padding) + padding`` by ``cols * (W + padding) + padding`` pixels; unused
    cells of the last row stay ``pad_value``.
    """
    _check_images(images)
    if images.dim() == 5:
        images = images[:, :, images.shape[2] // 2]
    n, _, h, w = images.shape
    if nrow is None:
        nrow = math.ceil(math.sqrt(n))
    if nrow < 1:
        raise ValueError(f"nrow must be >= 1, got {nrow}")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    cols = min(nrow, n)
    rows = math.ceil(n / nrow)
    cells = to_uint8(images)  # [N, H, W, 3]
    grid = np.full((rows * (h + padding) + padding, cols * (w + padding) + padding, 3), pad_value, dtype=np.uint8)
    for k in range(n):
        r, c = divmod(k, nrow)
        y = padding + r * (h + padding)
        x = padding + c * (w + padding)
        grid[y : y + h, x : x + w] = cells[k]
    return grid


def save_grid_png(
    images: torch.Tensor | np.ndarray, path: str, prompts: list[str] | None = None, *, nrow: int | None = None
) -> str:
    """Save a grid PNG of ``images`` (a tensor, see :func:`image_grid`, or a ready uint8 grid).

    ``prompts``, when given, are stored in the PNG's text metadata under ``"prompts"`` (a JSON
    list, in grid order) instead of being drawn, so no font is needed and pixels stay exact.
    Returns ``path``.
    """
    from PIL import Image, PngImagePlugin

    grid = images if isinstance(images, np.ndarray) else image_grid(images, nrow)
    if grid.dtype != np.uint8 or grid.ndim != 3 or grid.shape[2] != 3:
        raise ValueError(f"grid must be a uint8 [H, W, 3] array, got {grid.dtype} {grid.shape}")
    info = None
    if prompts is not None:
        info = PngImagePlugin.PngInfo()
        info.add_itxt("prompts", json.dumps(list(prompts), ensure_ascii=False))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(grid, mode="RGB").save(path, format="PNG", pnginfo=info)
    return path


def _check_video(video: torch.Tensor) -> None:
    if not isinstance(video, torch.Tensor) or video.dim() != 4 or video.shape[0] != 3:
        got = tuple(video.shape) if isinstance(video, torch.Tensor) else type(video).__name__
        raise ValueError(f"video must be a [3, F, H, W] tensor, got {got}")


def save_video_gif(video: torch.Tensor, path: str, fps: int = 8) -> str:
    """Save one clip ``[3, F, H, W]`` in ``[0, 1]`` as a looping animated GIF (PIL). Returns ``path``.

    GIF has a 256-colour palette per frame, so colours are quantised (preview quality).
    """
    from PIL import Image

    _check_video(video)
    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    frames = to_uint8(video.permute(1, 0, 2, 3))  # [F, H, W, 3]
    pil = [Image.fromarray(f, mode="RGB") for f in frames]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    duration = max(int(round(1000.0 / fps)), 1)
    pil[0].save(path, format="GIF", save_all=True, append_images=pil[1:], duration=duration, loop=0)
    return path


# ----------------------------------------------------------------------------- validation


@dataclass
class ValidationResult:
    """What one validation pass produced (plain data: safe to ship between processes)."""

    step: int
    reward_mean: float
    rewards: list[float]
    grid_path: str
    gif_paths: list[str] = field(default_factory=list)
    logged_grid_path: str | None = None  # the grid of the first ``log_images`` images (None: log grid_path)

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        """Scalar metrics for a tracker: ``{prefix}/reward_mean``, ``_std``, ``_min``, ``_max``."""
        r = np.asarray(self.rewards, dtype=np.float64)
        return {
            f"{prefix}/reward_mean": float(self.reward_mean),
            f"{prefix}/reward_std": float(r.std()) if r.size else 0.0,
            f"{prefix}/reward_min": float(r.min()) if r.size else 0.0,
            f"{prefix}/reward_max": float(r.max()) if r.size else 0.0,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def run_validation(
    adapter: DiffusionAdapter,
    prompts: list[str],
    settings: SamplingSettings,
    reward_fn,
    *,
    seed: int,
    step: int,
    out_dir: str,
    batch_size: int | None = None,
    nrow: int | None = None,
    records: Sequence[Mapping[str, Any]] | None = None,
    log_images: int | None = None,
    give_latents: Callable[[dict[str, torch.Tensor] | None], None] | None = None,
) -> ValidationResult:
    """Sample ``prompts`` deterministically, score them, save the grid (and GIFs for video).

    Writes ``out_dir/val_step{step:06d}.png`` (prompts in its metadata) and, for video models,
    ``out_dir/val_step{step:06d}_{i}.gif`` for the first :data:`MAX_VIDEO_GIFS` prompts.
    ``reward_fn(images, prompts) -> [N]`` is any :class:`~verl_digen.rewards.RewardFn`.
    ``log_images``: also write ``val_step{step:06d}_logged.png``, the grid of the first that many
    images, for the loggers (veRL's ``trainer.log_val_generations``); the full grid stays.
    ``give_latents``: the reward's :meth:`~verl_digen.rewards.RewardFn.give_sample_tensors` (with
    ``validation=True``), called before it scores: with the samples' final latents when
    ``settings.keep_final_latents``, else None.
    """
    prompts = list(prompts)
    chunks: list[dict[str, torch.Tensor]] | None = [] if settings.keep_final_latents else None
    images = sample_deterministic(adapter, prompts, settings, seed=seed, batch_size=batch_size, records=records,
                                  latents_out=chunks)
    if give_latents is not None:
        give_latents({k: torch.cat([c[k] for c in chunks]) for k in chunks[0]} if chunks else None)
    with torch.no_grad():
        rewards = reward_fn(images, prompts).detach().float().cpu().reshape(-1)
    if rewards.shape[0] != len(prompts):
        raise RuntimeError(f"reward_fn returned {tuple(rewards.shape)} scores for {len(prompts)} prompts")
    os.makedirs(out_dir, exist_ok=True)
    grid_path = save_grid_png(images, os.path.join(out_dir, f"val_step{step:06d}.png"), prompts, nrow=nrow)
    logged = None
    if log_images is not None and log_images < len(prompts):
        logged = save_grid_png(images[:log_images], os.path.join(out_dir, f"val_step{step:06d}_logged.png"),
                               prompts[:log_images], nrow=nrow)
    gif_paths = []
    if images.dim() == 5:
        for i in range(min(MAX_VIDEO_GIFS, images.shape[0])):
            gif_paths.append(save_video_gif(images[i], os.path.join(out_dir, f"val_step{step:06d}_{i}.gif")))
    return ValidationResult(
        step=int(step),
        reward_mean=float(rewards.mean()),
        rewards=[float(r) for r in rewards],
        grid_path=grid_path,
        gif_paths=gif_paths,
        logged_grid_path=logged,
    )
