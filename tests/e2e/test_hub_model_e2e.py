"""digen.model.path as a hub id through veRL's own entry point: ``main_ppo`` trains a model given by
hub id, offline (HF_HUB_OFFLINE=1) against a cache populated with the tiny FLUX. The resolution
and its checks: tests/unit/test_hub_model.py."""

from __future__ import annotations

import glob
import json

import pytest

from test_hub_model import REPO_ID, populate_hub_cache


@pytest.mark.e2e
@pytest.mark.slow
def test_main_ppo_trains_a_model_given_by_hub_id_offline(tmp_path, tiny_flux, tiny_cache):
    """The user's path through veRL's own entry point: HF_HUB_OFFLINE=1 and HF_HOME set before
    the job starts, then ``actor_rollout_ref.model.path=<hub id>`` with the issue's keys and
    veRL-format parquet; the ground truth reaches the custom reward file."""
    from test_verl_entry import REWARD_FILE, ROWS, main_ppo, seen, verl_parquet

    hf_home = tmp_path / "hf"
    populate_hub_cache(str(hf_home / "hub"), REPO_ID, tiny_flux)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "my_reward.py").write_text(REWARD_FILE)
    train = verl_parquet(str(tmp_path / "train.parquet"), ROWS)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub")}
    proc = main_ppo(
        run_dir, f"actor_rollout_ref.model.path={REPO_ID}", f"data.train_files={train}", f"data.val_files={train}",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "reward.custom_reward_function.path=my_reward.py",
        "reward.custom_reward_function.name=compute_score", "trainer.total_training_steps=2",
        "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.logger=[console]", "trainer.val_before_train=false",
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out_dirs = glob.glob(str(run_dir / "runs" / "*" / "*" / "metrics.jsonl"))
    assert len(out_dirs) == 1, out_dirs
    with open(out_dirs[0]) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    truth = dict(ROWS)
    assert all(c["ground_truth"] == truth[c["prompt"]] for c in seen(run_dir)) and len(seen(run_dir)) == 2 * 2 * 4
