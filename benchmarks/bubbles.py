"""Where the idle time sits, with and without TSP, TAG and GAT, on the tiny model (CPU).

    python benchmarks/bubbles.py [--steps 8] [--out runs/bubbles] [--only nogat,gat]

Runs eight disaggregated+GAP configurations on the same work and prints, per run, the
steady-state bubble fraction, the trainers' head bubble (idle before their first micro-batch
of a step), the rollout's drain bubble (idle after its last group of a step) and images/s:

- dp2:      2 rollout workers, data parallel            (baseline for TSP)
- tsp2:     2 rollout workers as one 2-stage TSP pipeline (docs/design.md: smaller drain: the last
            group arrives alone instead of in a burst of 2)
- notag:    1 rollout, 1 trainer, a 2-step SDE window (training is cheap: trainers idle)
- tag:      the same with TAG on (docs/design.md: smaller trainer head bubble)
- nogat:    1 rollout, 1 trainer, every denoising step trained (training is dear: rollout idles)
- gat:      the same with GAT on (the rollout worker trains micro-batches: smaller drain bubble)
- rr22:     2 rollout workers, 2 trainers, one-step-off (TCSS), work dealt round-robin
- pull22:   the same with pulled units (digen.units.pull, 2 row slices per micro-batch): a worker
            that finishes early takes the next unit instead of waiting behind a slow one

Every number comes from the run's own timeline (timeline.jsonl, metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os

CONFIGS = {
    "dp2": ["trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=2"],
    "tsp2": ["trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=2", "digen.tsp.stages=2"],
    "notag": ["digen.sampling.sde_window.mode=fixed", "digen.sampling.sde_window.size=2"],
    "tag": ["digen.sampling.sde_window.mode=fixed", "digen.sampling.sde_window.size=2", "digen.tag.enable=true"],
    "nogat": ["digen.sampling.sde_window.mode=all", "digen.batch.train_micro_batch_groups=1"],
    "gat": ["digen.sampling.sde_window.mode=all", "digen.batch.train_micro_batch_groups=1", "digen.gat.enable=true"],
    "rr22": ["trainer.n_gpus_per_node=4", "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=2",
             "digen.async.max_staleness=1"],
    "pull22": ["trainer.n_gpus_per_node=4", "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=2",
               "digen.async.max_staleness=1", "digen.units.pull=true", "digen.units.train_slices=2"],
}
COMMON = [
    "digen.placement=disaggregated", "digen.gap.enable=true", "digen.pools.trainer.devices=1",
    "digen.batch.groups_per_step=8", "digen.progress_bar=false", "trainer.logger=[]",
]


def main() -> None:
    from verl_digen.config.compose import compose_config
    from verl_digen.trainer.loop import run_training

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="runs/bubbles")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configs to run")
    args = parser.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; valid: {', '.join(CONFIGS)}")
    rows = []
    for name in names:
        extra = CONFIGS[name]
        cfg = compose_config(COMMON + extra + [f"trainer.total_training_steps={args.steps}",
                                                f"digen.output_dir={os.path.join(args.out, name)}"])
        result = run_training(cfg)
        steady = result.metrics[1:]
        wall = sum(m["step_time_s"] for m in steady)

        def w(key: str) -> float:
            return sum(m[key] * m["step_time_s"] for m in steady) / wall

        rows.append({
            "config": name,
            "devices": result.devices,
            "images_per_s": sum(m["images_per_s"] * m["step_time_s"] for m in steady) / wall,
            "bubble_fraction": w("bubble_fraction"),
            "head_trainer": w("bubble/head_trainer"),
            "drain_rollout": w("bubble/drain_rollout"),
            "tag_groups_per_step": sum(m.get("tag/groups", 0) for m in steady) / len(steady),
            "gat_micro_batches_per_step": sum(m.get("gat/micro_batches", 0) for m in steady) / len(steady),
        })
    print(f"{'config':<7} {'devices':>7} {'images/s':>9} {'bubble':>7} {'head(trainer)':>14} {'drain(rollout)':>15} "
          f"{'tag groups':>10} {'gat mbs':>8}")
    for r in rows:
        print(f"{r['config']:<7} {r['devices']:>7} {r['images_per_s']:>9.2f} {r['bubble_fraction']:>7.3f} "
              f"{r['head_trainer']:>14.3f} {r['drain_rollout']:>15.3f} {r['tag_groups_per_step']:>10.2f} "
              f"{r['gat_micro_batches_per_step']:>8.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bubbles.json"), "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
