"""What crosses the Ray object store each step: the bytes of the trajectory records.

A generate task's output (:func:`verl_digen.workers.sampling.finish_groups`) is put in the object
store once and read by the reward and by the trainer (each deserialises a copy); under TCSS the
next step's records are in flight while this step's are trained, twice as many. What a record
holds per sample, with ``S`` denoising steps and ``K`` latents carried (each trained step's
input and output, :func:`~verl_digen.workers.sampling.carried_latent_steps`)::

    latents       K x latent elements x 4    fp32, model space
    latent_steps  K x 8                      int64
    log_probs     S x 4,  sigmas (S+1) x 4   fp32
    train_mask, sde_mask  2 x S              bool
    images        3 x F x H x W              uint8
    text          each conditioning row      only without a prompt cache (the text encoders'
                                             output rows, as encode_prompts gives them)
    group_id, sample_index, prompt_index, policy_version   4 x 8   int64

plus the prompt, its record and (with a prompt cache) the embeddings' digests, pickled: a few
hundred bytes a sample, measured (:func:`trajectory_payload_bytes`) but not predicted.

:func:`trajectory_bytes` is the prediction from the sampling settings and the model's configs
(the latent layout of ``memory.trace``, the size rules of each family's adapter), exactly what
the code puts in a record (``tests/unit/test_object_store.py`` ties the two on a real trajectory);
:func:`step_bytes` scales it to a step of a config, :func:`describe` is the line
``python -m verl_digen.check`` prints.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl import DataProto

    from verl_digen.config.schema import DigenConfig

# The int64 columns of every record: group_id, sample_index, prompt_index, policy_version.
INDEX_COLUMNS = 4


@dataclass(frozen=True)
class TrajectoryBytes:
    """Bytes of one sample of a trajectory record, by field (the pickled strings excepted)."""

    latents: int
    latent_steps: int
    log_probs: int
    sigmas: int
    masks: int
    images: int
    text: int
    columns: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def trajectory_bytes(*, num_steps: int, carried: int, latent_elements: int, pixel_elements: int,
                     text_bytes: int = 0, final_latents: bool = False) -> TrajectoryBytes:
    """One sample's bytes: ``carried`` latents (``K``) of ``latent_elements`` each (channels x
    frames x h x w), ``pixel_elements`` per image (3 x frames x height x width), ``text_bytes``
    of conditioning when it travels (0 with a prompt cache); ``final_latents``: the final latents
    too, for a reward that reads them (veRL-Omni's ``pipeline.output_type`` latent / both)."""
    k = carried + int(final_latents)
    return TrajectoryBytes(
        latents=4 * k * latent_elements,
        latent_steps=8 * carried,
        log_probs=4 * num_steps,
        sigmas=4 * (num_steps + 1),
        masks=2 * num_steps,
        images=pixel_elements,
        text=text_bytes,
        columns=8 * INDEX_COLUMNS,
    )


def trajectory_payload_bytes(data: DataProto) -> int:
    """Measured bytes of a record as it is serialised: every tensor's elements (views count their
    own elements: ``DataProto`` pickles a consolidated copy), the numeric columns, and the object
    columns (prompts, records, digests) pickled; pickle's and ``torch.save``'s framing excepted."""
    import numpy as np

    total = 0
    if data.batch is not None:
        for t in data.batch.values(include_nested=True, leaves_only=True):
            total += t.numel() * t.element_size()
    for column in data.non_tensor_batch.values():
        if column.dtype == np.dtype(object):
            total += len(pickle.dumps(column.tolist(), protocol=pickle.HIGHEST_PROTOCOL))
        else:
            total += column.nbytes
    return total


def latent_elements(family: str, config_path: str | None, dtype: str, height: int, width: int, num_frames: int) -> int:
    """Elements of one sample's latents (FLUX and Qwen-Image pack 2x2 patches: the same count)."""
    from verl_digen.memory.trace import TraceShape, latent_layout

    lay = latent_layout(TraceShape(family, config_path, dtype, height, width, num_frames))
    return lay["channels"] * lay["frames"] * lay["h"] * lay["w"]


@dataclass(frozen=True)
class StepBytes:
    """A config's records per step: ``sample`` one sample's, ``samples`` per step, ``exact``
    False when ``K`` is an upper bound (a subsampled window's trained steps need not be
    consecutive), ``text_carried`` when the embeddings travel (no prompt cache: not counted)."""

    sample: TrajectoryBytes
    samples: int
    exact: bool
    text_carried: bool
    in_flight_factor: int  # TCSS: the next step's records are in flight with this step's

    @property
    def per_step(self) -> int:
        return self.sample.total * self.samples


def step_bytes(cfg: DigenConfig, model_path: str | None = None) -> StepBytes:
    """The trajectory bytes of a step of ``cfg`` at its real size: the model's configs at
    ``model_path`` (default ``digen.model.path``; the family's shipped ones when that is not a
    model directory here), the SDE window of training step 0 (its size is every step's)."""
    import torch

    from verl_digen.algos.window import select_sde_window, subsample_timesteps
    from verl_digen.memory.plan import model_config_path
    from verl_digen.rewards.custom import reward_wants_latents

    s = cfg.sampling
    config_path = model_config_path(model_path if model_path is not None else cfg.model.path)
    family = cfg.model.arch
    if family is None:
        from verl_digen.models.registry import detect_arch

        if config_path is None:
            raise ValueError("no model family to take the latent layout from: digen.model.arch is unset and "
                             "no model directory with a model_index.json is at hand (set either)")
        family = detect_arch(config_path)
    window = select_sde_window(s.num_steps, s.sde_window, training_step=0, seed=cfg.seed)
    trained = subsample_timesteps(window, s.timestep_fraction, generator=torch.Generator().manual_seed(0))
    # A whole window (consecutive steps) carries len + 1 latents; a subsampled one, whose trained
    # steps need not be consecutive, at most twice its trained steps (and never more than the window's).
    exact = len(trained) == len(window)
    carried = len(window) + 1 if exact else min(2 * len(trained), len(window) + 1)
    sample = trajectory_bytes(
        num_steps=s.num_steps, carried=carried,
        latent_elements=latent_elements(family, config_path, "bf16", s.height, s.width, s.num_frames),
        pixel_elements=3 * s.num_frames * s.height * s.width,
        final_latents=reward_wants_latents(cfg.reward.as_spec()),
    )
    return StepBytes(sample=sample, samples=cfg.batch.groups_per_step * cfg.batch.group_size, exact=exact,
                     text_carried=not cfg.prompt_cache.enable,
                     in_flight_factor=2 if cfg.async_.max_staleness > 0 else 1)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def describe(cfg: DigenConfig, model_path: str | None = None) -> list[str]:
    """``python -m verl_digen.check``'s line: the object-store bytes per step (not predicted, and
    why, when the model's configs are not at hand: a built-in tiny model the check does not build)."""
    try:
        b = step_bytes(cfg, model_path)
    except (ValueError, FileNotFoundError) as e:
        return [f"object-store bytes per step: not predicted ({e})"]
    bound = "" if b.exact else "at most "
    line = (f"object-store bytes per step: {bound}{_size(b.per_step)} of trajectories "
            f"({b.samples} samples x {_size(b.sample.total)}: {_size(b.sample.latents)} of latents, "
            f"{_size(b.sample.images)} of pixels), read once by the reward and once by the trainer")
    if b.in_flight_factor > 1:
        line += f"; TCSS keeps two steps in flight: {bound}{_size(b.per_step * b.in_flight_factor)}"
    if b.text_carried:
        line += ("; plus each sample's text embeddings, which travel without digen.prompt_cache.enable "
                 "(not counted here)")
    return [line]

