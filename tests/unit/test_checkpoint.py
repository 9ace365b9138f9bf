"""Checkpoint and resume: atomic writes, exact resume, failures that stop cleanly, export. The
checkpoint files here; the runs (resume after a kill, stops that checkpoint, export):
tests/e2e/test_checkpoint_e2e.py."""

from __future__ import annotations

import pytest
import torch

from verl_digen.trainer.checkpoint import CheckpointError, checkpoint_at, find_latest
from checkpoints import save_earlier_layout, save_one_rank


# ----------------------------------------------------------------------------- unit


def _save(root, step, **kw):
    return save_one_rank(root, step, **kw)


def test_latest_complete_checkpoint_is_found(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    ckpt = find_latest(str(tmp_path))
    assert ckpt.step == 2 and torch.equal(ckpt.weights()["bias"], torch.full((2,), 2.0))


def test_a_checkpoint_of_the_earlier_layout_still_gives_its_weights(tmp_path):
    ckpt = save_earlier_layout(tmp_path, 3, {"w": torch.full((2,), 3.0)})
    ckpt.verify()
    assert not ckpt.sharded and torch.equal(ckpt.weights()["w"], torch.full((2,), 3.0))


def test_checkpoint_interrupted_mid_write_is_not_picked_by_auto(tmp_path):
    _save(tmp_path, 1)
    # A save killed before the rename: a temporary directory, and a step dir without meta.json.
    (tmp_path / ".tmp-global_step_2-abc").mkdir()
    (tmp_path / ".tmp-global_step_2-abc" / "weights.safetensors").write_bytes(b"partial")
    (tmp_path / "global_step_3").mkdir()
    (tmp_path / "global_step_3" / "weights.safetensors").write_bytes(b"partial")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    assert find_latest(str(tmp_path)).step == 1


def test_max_to_keep_prunes_the_oldest(tmp_path):
    for k in range(1, 5):
        _save(tmp_path, k, max_to_keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("global_step")) == [
        "global_step_3", "global_step_4"]


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_at(str(tmp_path / "global_step_9"))
    (tmp_path / "global_step_9").mkdir()
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint_at(str(tmp_path / "global_step_9"))
