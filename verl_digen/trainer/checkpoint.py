"""Checkpoints with veRL's layout and keys, written atomically.

Layout (as veRL's trainers): ``<trainer.default_local_dir>/global_step_<k>/`` plus
``latest_checkpointed_iteration.txt``. A checkpoint directory is built under a temporary
name and renamed into place only once every file and ``meta.json`` are written, so a crash
mid-save never leaves a directory that looks complete; :func:`find_latest` also requires
``meta.json`` with ``complete: true``.

Contents of ``global_step_<k>``:

- ``weights.safetensors``  the trained state (LoRA-only when LoRA is on), policy version k
- ``trainer.pt``           optimizer state, EMA state, trainer RNG state
- ``controller.pt``        data position (prompt sampler state), metrics history, step
- ``meta.json``            step, strategy, model path, ``complete: true`` (written last)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

TRACKER = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint asked for cannot be used; the message names it and why."""


@dataclass
class Checkpoint:
    path: str
    step: int

    def weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(os.path.join(self.path, "weights.safetensors"))

    def trainer_state(self) -> dict[str, Any]:
        return torch.load(os.path.join(self.path, "trainer.pt"), map_location="cpu", weights_only=False)

    def controller_state(self) -> dict[str, Any]:
        return torch.load(os.path.join(self.path, "controller.pt"), map_location="cpu", weights_only=False)

    def meta(self) -> dict[str, Any]:
        with open(os.path.join(self.path, "meta.json")) as f:
            return json.load(f)


def _atomic_write_text(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_complete(path: str) -> bool:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return bool(json.load(f).get("complete"))
    except (OSError, ValueError):
        return False


def save_checkpoint(
    root: str,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    controller_state: dict[str, Any],
    meta: dict[str, Any],
    max_to_keep: int | None = None,
) -> Checkpoint:
    """Write ``global_step_<step>`` atomically, update the tracker, prune old checkpoints."""
    from safetensors.torch import save_file

    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"global_step_{step}")
    tmp = tempfile.mkdtemp(dir=root, prefix=f".tmp-global_step_{step}-")
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, "weights.safetensors"))
        torch.save(trainer_state, os.path.join(tmp, "trainer.pt"))
        torch.save(controller_state, os.path.join(tmp, "controller.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "step": step, "complete": True}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write_text(os.path.join(root, TRACKER), str(step))
    if max_to_keep is not None and max_to_keep > 0:
        for old_step, path in sorted(_complete_steps(root))[:-max_to_keep]:
            shutil.rmtree(path, ignore_errors=True)
    return Checkpoint(final, step)


def _complete_steps(root: str) -> list[tuple[int, str]]:
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and is_complete(path):
            out.append((int(m.group(1)), path))
    return out


def find_latest(root: str) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` (tracker first, then a scan)."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            step = int(f.read().strip())
        path = os.path.join(root, f"global_step_{step}")
        if is_complete(path):
            return Checkpoint(path, step)
    except (OSError, ValueError):
        pass
    steps = _complete_steps(root)
    if not steps:
        return None
    step, path = max(steps)
    return Checkpoint(path, step)


def checkpoint_at(path: str) -> Checkpoint:
    """A specific checkpoint directory (``trainer.resume_from_path``), checked for completeness."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if not os.path.isdir(path):
        raise CheckpointError(f"trainer.resume_from_path={path!r} does not exist")
    if m is None:
        raise CheckpointError(f"trainer.resume_from_path={path!r} is not a global_step_<k> checkpoint directory")
    if not is_complete(path):
        raise CheckpointError(f"trainer.resume_from_path={path!r} is incomplete (no meta.json with complete=true)")
    return Checkpoint(path, int(m.group(1)))
