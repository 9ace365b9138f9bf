"""The adapter interface every diffusion architecture implements.

An adapter wraps the diffusers components of one architecture (text encoders, tokenizers,
the denoising transformer, the VAE, the scheduler config) behind the few calls the RL loop
needs. Latents live in *model space* throughout rollout and training (packed tokens for
FLUX, ``[B, C, h, w]`` for SD3); only :meth:`decode` turns them into pixels.

Flow-matching convention (diffusers, Flow-GRPO): ``x_sigma = (1 - sigma) * x0 + sigma * noise``,
the model predicts ``velocity = noise - x0`` and an Euler step is
``x_next = x + (sigma_next - sigma) * velocity``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

# Conditioning for a batch: every tensor is batch-first ([B, ...]) so it can ride in a
# DataProto next to the latents and be sliced per sample.
Conditioning = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SampleSpec:
    """What to sample: pixel size (and frames for video) and the guidance settings."""

    height: int
    width: int
    num_frames: int = 1
    guidance_scale: float = 1.0  # true CFG scale (> 1 runs the negative branch)
    distilled_guidance: float | None = None  # FLUX.1-dev style guidance embedding


class DiffusionAdapter(abc.ABC):
    """One architecture's diffusers components behind the RL loop's calls."""

    arch: ClassVar[str]

    # The trainable denoiser (FluxTransformer2DModel, SD3Transformer2DModel, ...).
    transformer: torch.nn.Module

    @classmethod
    @abc.abstractmethod
    def from_pretrained(
        cls, path: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> "DiffusionAdapter":
        """Load every component from a local diffusers-format directory."""

    @abc.abstractmethod
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Text encoders -> conditioning tensors, each ``[B, ...]``. No grad."""

    @abc.abstractmethod
    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Initial noise in model space, ``[B, ...]``, fp32, drawn from ``generator``."""

    @abc.abstractmethod
    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """Noise levels ``[num_steps + 1]`` (fp32, decreasing, last is 0) as the pipeline uses them."""

    @abc.abstractmethod
    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        spec: SampleSpec,
        negative_cond: Conditioning | None = None,
    ) -> torch.Tensor:
        """Velocity ``[B, ...]`` (same shape as ``latents``) at noise level ``sigma`` ``[B]``.

        With ``spec.guidance_scale > 1`` and ``negative_cond`` given, runs true CFG:
        ``v_neg + scale * (v_pos - v_neg)``. Differentiable w.r.t. the transformer.
        """

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Model-space latents -> pixels ``[B, 3, H, W]`` (``[B, 3, F, H, W]`` for video) in [0, 1]."""

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    # Set by :meth:`release_text_encoders`; :meth:`encode_prompts` then raises.
    text_encoders_released: bool = False

    def release_text_encoders(self) -> int:
        """Drop the text encoders and tokenizers (once every prompt the run needs is in a
        :class:`~verl_digen.models.prompt_cache.PromptEmbeddingCache`); returns the bytes of
        parameters and buffers freed. :meth:`encode_prompts` raises ``RuntimeError`` afterwards."""
        raise NotImplementedError(f"{type(self).__name__} does not implement release_text_encoders")


TEXT_ENCODERS_RELEASED_MESSAGE = "text encoders were released; use the prompt cache"


def release_modules(adapter: DiffusionAdapter, names: tuple[str, ...]) -> int:
    """Set the attributes ``names`` of ``adapter`` (text encoders, tokenizers) to ``None`` after
    counting the parameter and buffer bytes of those that are modules; mark the adapter released.

    The memory is returned to the allocator once nothing else references the modules (the CUDA
    cache is emptied when any of them lived on a GPU). Returns the bytes counted; releasing
    twice frees nothing the second time and returns 0."""
    import gc

    freed, on_cuda, seen = 0, False, set()
    for name in names:
        module = getattr(adapter, name, None)
        if isinstance(module, torch.nn.Module):
            for t in (*module.parameters(), *module.buffers()):
                if t.device.type != "meta" and id(t) not in seen:
                    seen.add(id(t))
                    freed += t.numel() * t.element_size()
                    on_cuda |= t.is_cuda
        setattr(adapter, name, None)
    adapter.text_encoders_released = True
    gc.collect()
    if on_cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


def require_text_encoders(adapter: DiffusionAdapter) -> None:
    """Raise a clear ``RuntimeError`` when ``adapter``'s text encoders were released."""
    if adapter.text_encoders_released:
        raise RuntimeError(
            f"{type(adapter).__name__}.encode_prompts: {TEXT_ENCODERS_RELEASED_MESSAGE} "
            "(PromptEmbeddingCache.encode serves the prompts warmed before the release)"
        )


def read_model_index(path: str) -> dict:
    """The ``model_index.json`` of a local diffusers-format directory, as a dict.

    Raises ``FileNotFoundError`` naming the path when the directory or the file is missing, so
    a typo in a config fails here rather than deep inside ``from_pretrained``.
    """
    import json
    import os

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path '{path}' does not exist (expected a local diffusers-format directory)")
    index_file = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_file):
        raise FileNotFoundError(
            f"no model_index.json in model path '{path}': expected a diffusers-format directory "
            "(e.g. written by DiffusionPipeline.save_pretrained or downloaded from the Hub)"
        )
    with open(index_file, encoding="utf-8") as f:
        return json.load(f)


def has_component(model_index: dict, name: str) -> bool:
    """Whether ``model_index.json`` lists component ``name`` (a ``[null, null]`` entry means dropped)."""
    entry = model_index.get(name)
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] is not None and entry[1] is not None


def batch_sigma(sigma: torch.Tensor | float, batch: int, device: torch.device | str) -> torch.Tensor:
    """Sigma as a float32 ``[B]`` tensor; a python float, 0-d or ``[1]`` tensor is broadcast."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=device).reshape(-1)
    if sigma.numel() == 1 and batch != 1:
        sigma = sigma.expand(batch)
    if sigma.shape != (batch,):
        raise ValueError(f"sigma must have shape [{batch}] (one per sample), got {tuple(sigma.shape)}")
    return sigma


def expand_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Broadcast a batch-of-1 tensor (e.g. one encoded negative prompt) to ``batch`` rows."""
    if x.shape[0] == batch:
        return x
    if x.shape[0] == 1:
        return x.expand(batch, *x.shape[1:])
    raise ValueError(f"conditioning has batch {x.shape[0]}, expected 1 or {batch}")
