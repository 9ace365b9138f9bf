"""veRL's own entry point runs the digen trainer mode: ``python -m verl.trainer.main_ppo
trainer.v1.trainer_mode=digen`` with veRL's keys, veRL-format parquet and a custom reward file
gives the run ``python -m verl_digen.main`` gives with the equivalent ``digen.*`` keys, and bad
veRL keys stop the job naming them.

The main_ppo runs are subprocesses running the exact command of issue 13. Their one addition is
in the environment: ``RAY_OVERRIDE_RESOURCES`` gives the Ray instance main_ppo starts 16
logical CPUs, because veRL's TaskRunner starts TransferQueue (a controller and 8 storage units
of 1 CPU each) before any trainer mode runs, more than this 2-core machine has (a GPU node has
them; a CPU user passes ``ray_kwargs.ray_init.num_cpus=16``).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from runs import metrics_lines, run

# The reward of the test: brightness pulled towards each sample's ground truth, logging every
# call next to itself so the test can see what reached it.
REWARD_FILE = '''
import json, os
import numpy as np

def compute_score(data_source, image, prompt, ground_truth, extra_info):
    with open(os.path.join(os.path.dirname(__file__), "seen.jsonl"), "a") as f:
        f.write(json.dumps({"data_source": data_source, "prompt": prompt, "ground_truth": ground_truth,
                            "extra_info": extra_info, "image": [type(image).__name__, list(image.size)]}) + "\\n")
    return -abs(float(np.asarray(image).mean()) / 255.0 - float(ground_truth))
'''

ROWS = [("a red cube", "0.8"), ("a dark night sky", "0.1"), ("a white cat", "0.9"), ("a gray stone", "0.5")]


def verl_parquet(path: str, rows: list[tuple[str, str]]) -> str:
    """A prompt file in veRL's RL format: chat prompt, data_source, reward_model, extra_info."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([
        {"data_source": "brightness_target", "prompt": [{"role": "user", "content": prompt}], "ability": "image",
         "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": i, "split": "train"}}
        for i, (prompt, truth) in enumerate(rows)]), path)
    return path


#: veRL's TaskRunner starts TransferQueue for every trainer mode; the digen mode keeps no data in it,
#: so one storage unit is enough (docs/verl_keys.md). veRL's 8 are 7 more actor processes to start
#: on a 2-core machine: about 20 s of each main_ppo run here.
ONE_TQ_UNIT = "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"


def main_ppo(cwd, *overrides: str, timeout: int = 400, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m verl.trainer.main_ppo trainer.v1.trainer_mode=digen OVERRIDES`` in ``cwd``: in a
    test that asks for the ``shared_ray`` fixture, joining the suite's shared Ray instance as a job
    joins a running cluster (``runs.shared_ray_driver_env``), else on a local instance of its own."""
    from runs import shared_ray_driver_env, shared_ray_main_ppo_overrides

    env = {**os.environ, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 16}),
           **shared_ray_driver_env(str(cwd), main_ppo=True), **(env or {})}
    return subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "trainer.v1.trainer_mode=digen", ONE_TQ_UNIT,
                           *shared_ray_main_ppo_overrides(), *overrides],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def seen(directory) -> list[dict]:
    with open(os.path.join(directory, "seen.jsonl")) as f:
        return [json.loads(line) for line in f]


# The keys whose values are the run's learning (timings differ between any two runs).
LEARNING = ("reward_mean", "reward_std", "actor/loss", "actor/grad_norm", "actor/approx_kl", "actor/ratio_mean",
            "policy_version")


@pytest.mark.e2e
@pytest.mark.slow
def test_main_ppo_runs_the_issue_command_like_verl_digen_main(tmp_path, tiny_flux, shared_ray):
    data = tmp_path / "data"
    data.mkdir()
    train = verl_parquet(str(data / "train.parquet"), ROWS)
    val = verl_parquet(str(data / "val.parquet"), ROWS[:2])
    runs = {}
    for name in ("verl", "digen"):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        (runs[name] / "my_reward.py").write_text(REWARD_FILE)

    proc = main_ppo(
        runs["verl"], f"actor_rollout_ref.model.path={tiny_flux}", f"data.train_files={train}",
        f"data.val_files={val}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "reward.custom_reward_function.path=my_reward.py", "reward.custom_reward_function.name=compute_score",
        "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.logger=[console]",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out_dirs = glob.glob(str(runs["verl"] / "runs" / "verl_examples" / "gsm8k-*"))
    assert len(out_dirs) == 1, out_dirs
    via_verl = metrics_lines(out_dirs[0])
    assert [m["step"] for m in via_verl] == [1, 2]

    # Every sample's ground truth, data_source and extra_info reached the user's function, with a PIL image.
    calls = seen(runs["verl"])
    # veRL's default trainer.val_before_train=true: the two validation prompts first, then steps x prompts x group size.
    assert len(calls) == 2 + 2 * 2 * 4
    assert sorted(c["prompt"] for c in calls[:2]) == sorted(p for p, _ in ROWS[:2])
    assert os.path.exists(os.path.join(out_dirs[0], "val_before_train.json"))
    truth = dict(ROWS)
    for call in calls:
        assert call["ground_truth"] == truth[call["prompt"]]
        assert call["data_source"] == "brightness_target" and call["extra_info"]["split"] == "train"
        assert call["image"] == ["Image", [32, 32]]

    # The same run, from our short form and our own keys.
    result = run(
        runs["digen"], "out", f"digen.model.path={tiny_flux}", f"digen.data.prompts={train}",
        f"digen.validation.prompts={val}", "digen.batch.groups_per_step=2", "digen.batch.group_size=4",
        "digen.batch.train_micro_batch_groups=1", "digen.batch.groups_per_task=1", "digen.reward.name=custom",
        f"+digen.reward.kwargs.path={runs['digen'] / 'my_reward.py'}", "+digen.reward.kwargs.function=compute_score",
        "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "trainer.nnodes=1",
        "trainer.val_before_train=true",  # veRL's default, which verl_digen.main's config turns off
        "digen.model.lora.enable=false",  # veRL's lora_rank=0 (unset above): full fine-tuning
    )
    via_digen = result.metrics
    with open(os.path.join(out_dirs[0], "val_before_train.json")) as f:
        assert json.load(f) == pytest.approx(result.extra["val_before_train"], rel=1e-5, abs=1e-8)
    for a, b in zip(via_verl, via_digen, strict=True):
        assert {k: a[k] for k in LEARNING} == pytest.approx({k: b[k] for k in LEARNING}, rel=1e-5, abs=1e-8)
    assert sorted(map(json.dumps, calls)) == sorted(map(json.dumps, seen(runs["digen"])))


@pytest.mark.e2e
@pytest.mark.slow
def test_main_ppo_names_a_model_path_that_does_not_exist(tmp_path):
    proc = main_ppo(tmp_path, "actor_rollout_ref.model.path=/nonexistent", "trainer.total_training_steps=2")
    assert proc.returncode != 0
    assert "actor_rollout_ref.model.path: model path '/nonexistent' does not exist" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout  # stopped in the driver, before Ray


@pytest.mark.e2e
@pytest.mark.slow
def test_main_ppo_names_a_checkpoint_of_another_model_in_its_driver(tmp_path):
    """A resume into a checkpoint another model wrote: main_ppo's driver lists the differences in
    one named line and exits 2, before Ray (it did so from inside veRL's TaskRunner, in a Ray and
    Hydra traceback)."""
    from checkpoints import save_one_rank

    identity = {"model_path": "/models/stable-diffusion-3.5-medium", "model_fingerprint": "another model's files",
                "arch": "sd3"}
    save_one_rank(tmp_path / "ck", 1, meta={"identity": identity})
    proc = main_ppo(tmp_path, f"trainer.default_local_dir={tmp_path / 'ck'}", "trainer.total_training_steps=3",
                    "trainer.logger=[console]")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "[verl-digen] error: " in proc.stderr and "was written by a different run" in proc.stderr
    assert "trained from /models/stable-diffusion-3.5-medium" in proc.stderr
    assert "digen.model.arch: checkpoint 'sd3', this run 'flux'" in proc.stderr
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stderr + proc.stdout


@pytest.mark.e2e
@pytest.mark.slow
def test_main_ppo_names_a_verl_key_that_cannot_apply(tmp_path):
    """veRL's default adv_estimator=gae written on main_ppo's command line: its driver's Hydra record
    of the command line tells it from the inherited default (which reads as unset), and the run
    stops before Ray naming it."""
    proc = main_ppo(tmp_path, "algorithm.adv_estimator=gae", "trainer.total_training_steps=2")
    assert proc.returncode != 0
    assert "algorithm.adv_estimator='gae' cannot apply: GAE needs a critic" in proc.stderr
