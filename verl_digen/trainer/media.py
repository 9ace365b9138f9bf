"""Driver-side validation: the workers' validation called and waited for (:func:`validate`), and
its images logged to TensorBoard and wandb.

The workers write the grids (:mod:`verl_digen.workers.validation`); the controller reads a
grid back and hands it to the loggers configured in ``trainer.logger``.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["validate", "log_images_tensorboard", "close_tensorboard_writers", "log_images_wandb"]

_TB_WRITERS: dict[str, object] = {}


def log_images_tensorboard(log_dir: str, tag: str, grid: np.ndarray, step: int) -> None:
    """Write ``grid`` (uint8 ``[H, W, 3]``) as image ``tag`` at ``step`` to a TensorBoard log in ``log_dir``.

    One ``SummaryWriter`` per ``log_dir`` is kept open (and flushed after each image) so
    repeated calls append to one event file; :func:`close_tensorboard_writers` closes them.
    """
    from torch.utils.tensorboard import SummaryWriter

    grid = np.asarray(grid)
    if grid.ndim != 3 or grid.shape[2] != 3:
        raise ValueError(f"grid must be [H, W, 3], got {grid.shape}")
    key = os.path.abspath(log_dir)
    writer = _TB_WRITERS.get(key)
    if writer is None:
        writer = SummaryWriter(log_dir=key)
        _TB_WRITERS[key] = writer
    writer.add_image(tag, grid, global_step=int(step), dataformats="HWC")
    writer.flush()


def close_tensorboard_writers() -> None:
    """Close the writers opened by :func:`log_images_tensorboard`."""
    while _TB_WRITERS:
        _, writer = _TB_WRITERS.popitem()
        writer.close()


def log_images_wandb(tag: str, grid: np.ndarray, step: int) -> bool:
    """``wandb.log({tag: wandb.Image(grid)}, step=step)`` if a wandb run is active.

    Never initialises wandb. Returns whether anything was logged (False when wandb is not
    installed or no run is active).
    """
    try:
        import wandb
    except ImportError:
        return False
    if getattr(wandb, "run", None) is None:
        return False
    wandb.log({tag: wandb.Image(grid)}, step=int(step))
    return True


def validate(actors: dict, ranks: list, job, step: int) -> dict[str, float]:
    """Validation of the run ``job`` (its config, prompts and output directory) at ``step`` on the workers
    ``ranks`` of ``actors`` (rank 0's result); its grid logged where ``trainer.logger`` says. A
    validation past ``digen.task_timeout_s`` is a ``TimeoutError`` naming it and the keys to change."""
    import ray
    from PIL import Image

    val_dir = os.path.join(job.output_dir, "val")
    try:
        out = ray.get([actors[w].validate.remote(job.val_prompts, step, val_dir, job.val_records) for w in ranks],
                      timeout=job.cfg.task_timeout_s)[0]
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(
            f"validation at step {step} ({len(job.val_prompts)} prompts) did not finish within "
            f"digen.task_timeout_s={job.cfg.task_timeout_s:g} s: raise digen.task_timeout_s, or validate fewer "
            f"prompts (data.val_max_samples / digen.validation.num_prompts)") from e
    grid = np.asarray(Image.open(out["grid_path"]).convert("RGB"))
    if "tensorboard" in job.trainer.logger:
        tb_dir = os.environ.get("TENSORBOARD_DIR", os.path.join(
            "tensorboard_log", job.trainer.project_name, job.trainer.experiment_name))
        log_images_tensorboard(tb_dir, "val/images", grid, step)
    if "wandb" in job.trainer.logger:
        log_images_wandb("val/images", grid, step)
    return out["metrics"]
