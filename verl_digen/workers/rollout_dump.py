"""Rollout dumps: veRL's ``trainer.rollout_data_dir`` (``digen.rollout_data_dir``) for images and videos.

veRL writes ``<dir>/<global_step>.jsonl`` every training step, one line per sample with
``input``, ``output``, ``gts``, ``score``, ``step`` and the reward's extra keys. Here the output
is a picture, so training step ``k`` (veRL's global step: 1-based, the ``step`` of
``metrics.jsonl``) writes, for every sample of its rollout batch:

- ``<dir>/<k>/g<group>_s<sample>.png``: the image the reward scored (exactly its uint8 pixels;
  the prompt in the PNG's text metadata, as validation grids keep theirs); a video is
  ``.gif``, as validation writes videos (:func:`~verl_digen.workers.validation.save_video_gif`);
- one line of ``<dir>/<k>.jsonl``: ``input`` (the prompt), ``output`` (that file's path relative
  to ``<dir>``), ``gts`` (the record's ground truth, null when it has none), ``score`` (the
  reward), ``step``, ``data_source`` (null when absent), ``group_id`` (the run's group id),
  ``sample_index`` (within the group), ``prompt_index`` (in the training prompts),
  ``policy_version`` (the weights the sample was drawn with), then the reward's extra per-sample
  numbers (a custom reward's ``{"score": ..., key: value}``; null where a sample has none).
  Lines are in group, then sample, order.

Who writes what (the simplest design that is correct when several workers score one step at
once): the worker that scores a group (``compute_reward``: fused, rollout, a TAG trainer or a
reward-pool worker) holds its pixels, so it writes the media files, each named by its unique
(group, sample): no two writers share a file and images never travel to the controller. It
returns the rows (a few hundred bytes each) with its
:class:`~verl_digen.workers.messages.RewardResult`; the controller writes ``<k>.jsonl`` once
step ``k``'s optimizer step ran (every group of the step is scored by then), alone, through a
temporary file renamed into place: the file is whole or absent, never interleaved.

On several nodes the media land on the node of the worker that scored them and the jsonl on the
controller's: give a path on a filesystem every node shares to get one complete dump (a
node-local path leaves each node with the images its workers scored, at the same relative paths).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

#: The keys of every row, in veRL's order first; a reward extra of the same name does not replace one.
ROW_KEYS = ("input", "output", "gts", "score", "step", "data_source", "group_id", "sample_index", "prompt_index",
            "policy_version")


def media_path(step: int, group: int, sample: int, video: bool) -> str:
    """A sample's media file, relative to the dump directory."""
    return os.path.join(str(step), f"g{group}_s{sample}.{'gif' if video else 'png'}")


def save_media(pixels: torch.Tensor, path: str, prompt: str) -> None:
    """One sample, fp32 in ``[0, 1]``: an image ``[3, H, W]`` as PNG (the prompt in its metadata),
    a video ``[3, F, H, W]`` as GIF, with validation's writers."""
    from verl_digen.workers.validation import save_grid_png, save_video_gif, to_uint8

    if pixels.dim() == 4:
        save_video_gif(pixels, path)
    else:
        save_grid_png(to_uint8(pixels), path, [prompt])


def _plain(value: Any) -> Any:
    """A record's value as JSON can hold it: numpy arrays and scalars (parquet columns) as lists
    and numbers; anything else as it is (``json.dumps(default=str)`` writes the rest as text)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def dump_samples(
    root: str,
    step: int,
    pixels: torch.Tensor,
    non_tensors: Mapping[str, np.ndarray],
    scores: torch.Tensor,
    extras: Mapping[str, torch.Tensor],
) -> list[dict[str, Any]]:
    """Write every sample's media under ``root/<step>/`` and return its jsonl rows.

    ``pixels``: ``[B, 3, H, W]`` (video ``[B, 3, F, H, W]``) fp32 in ``[0, 1]``, what the reward
    scored; ``non_tensors``: the trajectory record's per-sample columns (``prompt``,
    ``group_id``, ``sample_index``, ``prompt_index``, ``policy_version``, and ``metadata`` when the
    prompts have records); ``scores`` ``[B]``; ``extras``: the reward's extra numbers, name ->
    ``[B]`` (NaN where absent)."""
    os.makedirs(os.path.join(root, str(step)), exist_ok=True)
    records = non_tensors.get("metadata")
    video = pixels.dim() == 5
    rows = []
    for i in range(pixels.shape[0]):
        prompt = str(non_tensors["prompt"][i])
        record = dict(records[i]) if records is not None else {}
        group, sample = int(non_tensors["group_id"][i]), int(non_tensors["sample_index"][i])
        output = media_path(step, group, sample, video)
        save_media(pixels[i], os.path.join(root, output), prompt)
        row: dict[str, Any] = {
            "input": prompt, "output": output, "gts": _plain(record.get("ground_truth")),
            "score": float(scores[i]), "step": step, "data_source": _plain(record.get("data_source")),
            "group_id": group, "sample_index": sample, "prompt_index": int(non_tensors["prompt_index"][i]),
            "policy_version": int(non_tensors["policy_version"][i]),
        }
        for name, values in extras.items():
            row.setdefault(name, _number(float(values[i])))
        rows.append(row)
    return rows


def write_step_rows(root: str, step: int, rows: Sequence[Mapping[str, Any]]) -> str:
    """Write ``root/<step>.jsonl``: ``rows`` (every scoring worker's, in any order) sorted by
    group and sample, through a temporary file renamed into place. Returns its path."""
    path = os.path.join(root, f"{step}.jsonl")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for row in sorted(rows, key=lambda r: (r["group_id"], r["sample_index"])):
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path
