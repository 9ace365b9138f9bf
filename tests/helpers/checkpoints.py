"""Small checkpoints that tests of the checkpoint files share: one trainer rank's, as a run
writes them, and one of the earlier driver-written layout, which export still reads."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from verl_digen.trainer.checkpoint import Checkpoint, save_checkpoint
from verl_digen.workers.sharded_state import save_rank_state


def save_one_rank(root, step: int, *, controller_state: dict[str, Any] | None = None,
                  meta: dict[str, Any] | None = None, max_to_keep: int | None = None) -> Checkpoint:
    """``global_step_<step>`` written by one unsharded trainer rank (DCP ``state/`` and
    ``trainer_rank0.pt``) and the driver: a ``Linear(4, 2)`` whose weights all equal ``step``."""
    module = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float(step))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return save_checkpoint(
        str(root), step,
        write_state=lambda tmp: save_rank_state(tmp, module=module, optimizer=optimizer, ema=None, lora_only=False,
                                                version=step, rank=0, group=None),
        controller_state=controller_state if controller_state is not None else {"step": step},
        meta=meta if meta is not None else {}, max_to_keep=max_to_keep,
    )


def save_earlier_layout(root, step: int, weights: dict[str, torch.Tensor]) -> Checkpoint:
    """A complete checkpoint of the layout before sharded checkpoints (``weights.safetensors``
    and ``trainer.pt``, written by the driver), as such a run left it."""
    from safetensors.torch import save_file

    from verl_digen.workers.sharded_state import file_record

    path = os.path.join(str(root), f"global_step_{step}")
    os.makedirs(path)
    save_file(weights, os.path.join(path, "weights.safetensors"))
    torch.save({"optimizer": {}}, os.path.join(path, "trainer.pt"))
    torch.save({"step": step}, os.path.join(path, "controller.pt"))
    files = {n: file_record(os.path.join(path, n)) for n in ("weights.safetensors", "trainer.pt", "controller.pt")}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"step": step, "files": files, "complete": True}, f)
    return Checkpoint(path, step)
