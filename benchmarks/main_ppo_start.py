"""What a ``main_ppo`` job costs before and after its steps on this machine, with veRL's 8
TransferQueue storage units and with 1.

veRL's TaskRunner starts TransferQueue (a controller and ``num_data_storage_units`` storage
actors) for every trainer mode; the digen mode keeps no data there. Each unit is one more actor
process to start, which on a small CPU machine is seconds each. This runs the same two-step
tiny-FLUX job (colocated on 2 CPU slots, the brightness reward) once per setting, one after the
other, and prints each run's wall time and the time its two steps took.

    python benchmarks/main_ppo_start.py            # 8 units, then 1
    python benchmarks/main_ppo_start.py --units 1  # one setting only

Wall times on a shared machine move by several seconds between runs; run it twice.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPTS = ["a red square", "a bright sky", "a dark room", "a white wall"]


def run_once(work: str, model: str, units: int) -> dict:
    run_dir = os.path.join(work, f"units{units}")
    os.makedirs(run_dir)
    prompts = os.path.join(work, "prompts.txt")
    env = {**os.environ, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 16})}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "trainer.v1.trainer_mode=digen",
           f"transfer_queue.backend.SimpleStorage.num_data_storage_units={units}",
           f"actor_rollout_ref.model.path={model}", f"data.train_files={prompts}", f"data.val_files={prompts}",
           "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "+digen.reward.name=brightness",
           "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "trainer.nnodes=1",
           "trainer.logger=[console]", "trainer.val_before_train=false"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the run with {units} unit(s) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (metrics,) = glob.glob(os.path.join(run_dir, "runs", "*", "*", "metrics.jsonl"))
    with open(metrics) as f:
        steps = sum(json.loads(line)["step_time_s"] for line in f)
    return {"units": units, "wall_s": round(wall, 1), "steps_s": round(steps, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, nargs="+", default=[8, 1])
    args = parser.parse_args(argv)
    from verl_digen.models.tiny import ensure_tiny

    with tempfile.TemporaryDirectory(prefix="digen_main_ppo_start_") as work:
        with open(os.path.join(work, "prompts.txt"), "w") as f:
            f.write("\n".join(PROMPTS) + "\n")
        model = ensure_tiny("flux", os.path.join(work, "tiny"))
        for units in args.units:
            row = run_once(work, model, units)
            print(f"{row['units']} storage unit(s): {row['wall_s']} s wall, {row['steps_s']} s of it in the 2 steps")


if __name__ == "__main__":
    main()
