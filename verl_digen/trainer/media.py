"""Driver-side logging of validation images: TensorBoard and wandb.

The workers write the grids (:mod:`verl_digen.workers.validation`); the controller reads a
grid back and hands it to the loggers configured in ``trainer.logger``.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["log_images_tensorboard", "close_tensorboard_writers", "log_images_wandb"]

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
