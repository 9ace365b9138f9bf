"""One ``examples/flowgrpo`` script run for real: FLUX OCR LoRA (disaggregated pools, GAP, TCSS, the
real OCR reward) trains for two steps on the tiny FLUX through the real ``main_ppo``, its batch
made tiny by arguments appended to the script's own, as a user appends them. Every script's
command line checked at its real size, and the workspace used here: tests/unit/test_examples.py."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from runs import shared_ray_driver_env, shared_ray_main_ppo_overrides
from test_verl_entry import ONE_TQ_UNIT
from test_examples import REPO, workspace  # noqa: F401 (workspace: a fixture)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)  # a whole main_ppo job (about 4 minutes alone; twice that beside another)
def test_the_flux_ocr_example_trains_two_steps_through_main_ppo(tmp_path, workspace, tiny_flux, shared_ray):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this venv's python
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "WORKSPACE": str(workspace),
           "MODEL_PATH": tiny_flux, "NUM_GPUS": "2", "ROLLOUT_GPUS": "1",
           "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 16}), "RAY_ADDRESS": "local"}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env.update(shared_ray_driver_env(str(run_dir), main_ppo=True))  # the job joins the suite's shared Ray instance
    tiny = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.pipeline.height=32", "actor_rollout_ref.rollout.pipeline.width=32",
            "actor_rollout_ref.rollout.pipeline.num_inference_steps=4", "actor_rollout_ref.rollout.algo.sde_window_range=[0,4]",
            "trainer.total_training_steps=2", "trainer.logger=[console]", ONE_TQ_UNIT,
            *shared_ray_main_ppo_overrides()]
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "flowgrpo", "flux", "run_flux_ocr_lora.sh"), *tiny],
                          cwd=run_dir, env=env, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (metrics,) = glob.glob(str(run_dir / "runs" / "flow_grpo" / "flux_ocr_lora-*" / "metrics.jsonl"))
    with open(metrics) as f:
        lines = [json.loads(line) for line in f]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in lines)  # the OCR reward of the run's images
    assert lines[1]["max_staleness_seen"] <= 1  # TCSS: one step off at most
