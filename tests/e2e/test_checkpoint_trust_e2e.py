"""Hardening, round two (issue 25), the resume: on one real one-step run, stale temporary folders
are removed on the next start, the checkpoint records the run's identity, a resume into a
different run (or another base model) is refused listing the differences, and a crafted DCP
metadata stops a resume before Ray. The checkpoint files alone: tests/unit/test_checkpoint_trust.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import ray

from runs import run_config
from verl_digen.config.schema import ConfigError
from verl_digen.trainer.checkpoint import CheckpointError, checkpoint_at
from test_checkpoint_trust import _craft_metadata


# ----------------------------------------------------------------------------- the same run?


@pytest.fixture(scope="module")
def one_step(tmp_path_factory, tiny_flux):
    """One real step with a checkpoint, started over a stale temporary folder a killed run left."""
    from verl_digen.trainer.loop import run_training

    tmp = tmp_path_factory.mktemp("resume")
    ck = tmp / "ck"
    stale = ck / ".tmp-global_step_7-abc123"
    (stale / "state").mkdir(parents=True)
    (stale / "state" / "__0_0.distcp").write_bytes(b"half written")
    run_training(run_config(tmp, "a", "trainer.total_training_steps=1", "trainer.save_freq=1",
                            f"trainer.default_local_dir={ck}"))
    return tmp, ck, stale


@pytest.mark.e2e
def test_stale_temporary_checkpoint_folders_are_removed_on_the_next_start(one_step):
    _, ck, stale = one_step
    assert not stale.exists()
    assert sorted(os.listdir(ck)) == [".digen.lock", "global_step_1", "latest_checkpointed_iteration.txt"]


@pytest.mark.e2e
def test_the_checkpoint_records_the_runs_identity(one_step, tiny_flux):
    _, ck, _ = one_step
    identity = checkpoint_at(str(ck / "global_step_1")).meta()["identity"]
    assert identity["model_path"] == tiny_flux and identity["arch"] == "flux"
    assert identity["lora_only"] is True and identity["lora_rank"] == 8 and identity["lora_alpha"] == 16.0
    assert identity["group_size"] == 4 and len(identity["model_fingerprint"]) == 64


def _trainer(tmp, ck, name, *overrides):
    from verl_digen.trainer.loop import DigenTrainer

    return DigenTrainer(run_config(tmp, name, "trainer.total_training_steps=2", f"trainer.default_local_dir={ck}",
                                   *overrides))


@pytest.mark.e2e
@pytest.mark.parametrize(("override", "listed"), [
    ("digen.model.lora.alpha=32", "digen.model.lora.alpha: checkpoint 16.0, this run 32.0"),
    ("digen.model.lora.rank=4", "digen.model.lora.rank: checkpoint 8, this run 4"),
    ("digen.model.lora.target_modules=[to_q,to_k]", "digen.model.lora.target_modules: checkpoint ["),
    ("digen.model.lora.enable=false", "digen.model.lora.enable: checkpoint True, this run False"),
    ("digen.batch.group_size=2", "digen.batch.group_size (actor_rollout_ref.rollout.n): checkpoint 4, this run 2"),
])
def test_resume_into_a_different_run_is_refused_listing_the_differences(one_step, override, listed):
    tmp, ck, _ = one_step
    with pytest.raises(CheckpointError, match="was written by a different run") as e:
        _trainer(tmp, ck, "b", override)
    assert listed in str(e.value)
    assert "digen.resume.allow_changes=[" in str(e.value)
    assert not ray.is_initialized()


@pytest.mark.e2e
def test_a_different_base_model_is_refused_and_a_copy_of_the_same_one_resumes(one_step, tiny_flux, capsys):
    tmp, ck, _ = one_step
    copy = tmp / "same_model"
    shutil.copytree(tiny_flux, copy)
    trainer = _trainer(tmp, ck, "c", f"digen.model.path={copy}")
    assert trainer.job.resume_from.step == 1
    assert "same files" in capsys.readouterr().out
    other = tmp / "other_model"
    shutil.copytree(tiny_flux, other)
    cfg_file = other / "transformer" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["_name_or_path"] = "retrained"
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"digen.model.path \(the model's files\): the checkpoint was trained "
                                              rf"from {tiny_flux}, this run loads {other}"):
        _trainer(tmp, ck, "d", f"digen.model.path={other}")
    # Accepted on purpose:
    assert _trainer(tmp, ck, "e", f"digen.model.path={other}",
                    "digen.resume.allow_changes=[model_fingerprint]").job.resume_from.step == 1
    with pytest.raises(ConfigError, match=r"digen.resume.allow_changes=\['lr'\]; valid: model_fingerprint"):
        _trainer(tmp, ck, "f", "digen.resume.allow_changes=[lr]")


@pytest.mark.e2e
def test_a_crafted_metadata_stops_a_resume_before_ray(one_step, tmp_path):
    from verl_digen.trainer.loop import run_training

    tmp, ck, _ = one_step
    crafted = tmp_path / "ck"
    shutil.copytree(ck / "global_step_1", crafted / "global_step_1")
    marker = tmp_path / "pwned"
    path = _craft_metadata(checkpoint_at(str(crafted / "global_step_1")), marker)
    with pytest.raises(CheckpointError, match=rf"{path}: refused"):
        run_training(run_config(tmp_path, "b", "trainer.total_training_steps=2", f"trainer.default_local_dir={crafted}"))
    assert not marker.exists()
    assert not ray.is_initialized()
