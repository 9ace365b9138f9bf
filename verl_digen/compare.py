"""``python -m verl_digen.compare --out DIR [hydra overrides]``: the same work, every mode.

Runs the main job several times with identical model, prompts, batch, steps, seeds and
device count (``trainer.n_gpus_per_node x trainer.nnodes``), switching the mechanisms on
one by one:

- ``colocated``: every device generates, then trains (the veRL-Omni baseline);
- ``disaggregated``: rollout and trainer pools, synchronous (train after the whole batch);
- ``+gap``: groups stream to the trainer as they finish;
- ``+tsp``: + time-step-parallel rollout pipelines (all rollout devices form one pipeline;
  trainer ranks split micro-batches by time step when there are >= 2); skipped with fewer
  than 2 rollout devices;
- ``+tag``: + trainer-assisted generation (share decided each step from measured rates);
- ``+tcss``: + one-step-constrained async (``digen.async.max_staleness=1``).

The mechanisms are cumulative; each row of ``summary.json`` lists its overrides.

Writes ``DIR/summary.json`` (rows: mode, devices, images_per_s, bubble_fraction,
reward_mean_last, wall_s, ...), ``DIR/compare.png``, each mode's run directory (metrics,
timeline, Gantt chart) under ``DIR/<mode>``, and prints a table. Throughput and bubble
fraction are steady-state figures: the first step (warm-up) is excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

MODES = ("colocated", "disaggregated", "+gap", "+tsp", "+tag", "+tcss")


def mode_overrides(mode: str, rollout_devices: int, trainer_devices: int) -> list[str] | None:
    """The overrides of ``mode``; mechanisms are cumulative (+tag also has GAP and TSP).

    None when the mode cannot run on this split (TSP needs >= 2 rollout devices).
    """
    if mode == "colocated":
        return ["digen.placement=colocated"]
    out = ["digen.placement=disaggregated", "digen.gap.enable=false", "digen.async.max_staleness=0"]
    order = MODES[1:]
    if mode not in order:
        raise SystemExit(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    level = order.index(mode)
    if level >= 1:
        out.append("digen.gap.enable=true")
    if level >= 2 and rollout_devices >= 2:
        out.append(f"digen.tsp.stages={rollout_devices}")
        if trainer_devices >= 2:
            out.append("digen.tsp.train_split=timestep")
    elif mode == "+tsp":
        return None
    if level >= 3:
        out.append("digen.tag.enable=true")
    if level >= 4:
        out.append("digen.async.max_staleness=1")
    return out


@dataclass
class Row:
    mode: str
    devices: int
    images_per_s: float
    images_per_device_s: float
    bubble_fraction: float
    reward_mean_last: float
    wall_s: float
    step_time_s: float
    weight_sync_s: float
    max_staleness_seen: int
    head_bubble: float
    drain_bubble: float
    overrides: list[str]
    output_dir: str


def _pool_split(overrides: list[str], devices: int) -> tuple[list[str], int, int]:
    """Pool sizes for the disaggregated modes: the user's, or half and half."""
    from verl_digen.config.compose import compose_config

    if any(o.startswith("digen.pools.") for o in overrides):
        cfg = compose_config(overrides)
        r, t = cfg.digen.pools.rollout, cfg.digen.pools.trainer
        return [], r.devices * r.nodes, t.devices * t.nodes
    rollout = max(1, devices // 2)
    trainer = max(1, devices - rollout)
    return [f"digen.pools.rollout.devices={rollout}", f"digen.pools.trainer.devices={trainer}"], rollout, trainer


def run_modes(out: str, overrides: list[str], modes: list[str]) -> list[Row]:
    from verl_digen.config.compose import compose_config
    from verl_digen.trainer.loop import run_training

    rows: list[Row] = []
    base = compose_config(overrides)
    devices = int(base.trainer.n_gpus_per_node) * int(base.trainer.nnodes)
    split, n_roll, n_train = _pool_split(overrides, devices)
    for mode in modes:
        mode_ovr = mode_overrides(mode, n_roll, n_train)
        if mode_ovr is None:
            print(f"[verl-digen] compare: skipping {mode}: TSP needs >= 2 rollout devices (have {n_roll})")
            continue
        run_dir = os.path.join(out, mode.replace("+", "plus_"))
        extra = mode_ovr + (split if mode != "colocated" else []) + [f"digen.output_dir={run_dir}"]
        cfg = compose_config(overrides + extra)
        result = run_training(cfg)
        steady = result.metrics[1:] or result.metrics
        step_time = sum(m["step_time_s"] for m in steady)
        images = sum(m["images_per_s"] * m["step_time_s"] for m in steady)

        def weighted(key: str) -> float:
            return sum(m[key] * m["step_time_s"] for m in steady) / step_time

        rows.append(
            Row(
                mode=mode,
                devices=result.devices,
                images_per_s=images / step_time,
                images_per_device_s=images / step_time / result.devices,
                bubble_fraction=weighted("bubble_fraction"),
                reward_mean_last=result.metrics[-1]["reward_mean"],
                wall_s=result.wall_s,
                step_time_s=step_time / len(steady),
                weight_sync_s=sum(m["weight_sync_s"] for m in steady) / len(steady),
                max_staleness_seen=max(m["max_staleness_seen"] for m in result.metrics),
                head_bubble=weighted("bubble/head_trainer"),
                drain_bubble=weighted("bubble/drain_rollout"),
                overrides=mode_ovr + (split if mode != "colocated" else []),
                output_dir=result.output_dir,
            )
        )
    return rows


def format_table(rows: list[Row]) -> str:
    base = next((r for r in rows if r.mode == "colocated"), rows[0])
    lines = [
        f"{'mode':<14} {'devices':>7} {'images/s':>9} {'vs coloc':>8} {'bubble':>7} {'head':>6} {'drain':>6} "
        f"{'step s':>7} {'sync s':>7} {'stale':>5} {'reward(last)':>12} {'wall s':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r.mode:<14} {r.devices:>7} {r.images_per_s:>9.2f} {r.images_per_s / base.images_per_s:>7.2f}x "
            f"{r.bubble_fraction:>7.3f} {r.head_bubble:>6.3f} {r.drain_bubble:>6.3f} "
            f"{r.step_time_s:>7.3f} {r.weight_sync_s:>7.4f} {r.max_staleness_seen:>5} "
            f"{r.reward_mean_last:>12.4f} {r.wall_s:>7.1f}"
        )
    return "\n".join(lines)


def save_chart(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    names = [r.mode for r in rows]
    axes[0].bar(names, [r.images_per_s for r in rows], color="#4C72B0")
    axes[0].set_title("images / s (steady state)")
    axes[1].bar(names, [r.bubble_fraction for r in rows], color="#C44E52")
    axes[1].set_title("bubble fraction")
    axes[1].set_ylim(0, 1)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for summary.json, charts and per-mode runs")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of: {', '.join(MODES)}")
    args, overrides = parser.parse_known_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from verl_digen.config.schema import ConfigError

    try:
        rows = run_modes(args.out, overrides, [m for m in args.modes.split(",") if m])
    except (ConfigError, FileNotFoundError) as e:
        print(f"[verl-digen] error: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump([r.__dict__ for r in rows], f, indent=2)
    save_chart(rows, os.path.join(args.out, "compare.png"))
    print(format_table(rows))
    print(f"[verl-digen] summary: {os.path.abspath(os.path.join(args.out, 'summary.json'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
