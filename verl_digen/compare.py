"""``python -m verl_digen.compare --out DIR [hydra overrides]``: the same work, every mode.

Runs the main job several times with identical model, prompts, batch, steps, seeds and
device count (``trainer.n_gpus_per_node x trainer.nnodes``), switching the mechanisms on
one by one:

- ``colocated``: every device generates, then trains (the veRL-Omni baseline);
- ``disaggregated``: rollout and trainer pools, synchronous (train after the whole batch);
- ``+gap``: groups stream to the trainer as they finish;
- ``+tcss``: GAP plus one-step-constrained async (``digen.async.max_staleness=1``).

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

MODES: dict[str, list[str]] = {
    "colocated": ["digen.placement=colocated"],
    "disaggregated": ["digen.placement=disaggregated", "digen.gap.enable=false", "digen.async.max_staleness=0"],
    "+gap": ["digen.placement=disaggregated", "digen.gap.enable=true", "digen.async.max_staleness=0"],
    "+tcss": ["digen.placement=disaggregated", "digen.gap.enable=true", "digen.async.max_staleness=1"],
}


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
    output_dir: str


def _split_overrides(overrides: list[str], devices: int) -> list[str]:
    """Default pool split for the disaggregated modes when the user gave none: half and half."""
    if any(o.startswith("digen.pools.") for o in overrides):
        return []
    rollout = max(1, devices // 2)
    return [f"digen.pools.rollout.devices={rollout}", f"digen.pools.trainer.devices={max(1, devices - rollout)}"]


def run_modes(out: str, overrides: list[str], modes: list[str]) -> list[Row]:
    from verl_digen.config.compose import compose_config
    from verl_digen.trainer.loop import run_training

    rows: list[Row] = []
    base = compose_config(overrides)
    devices = int(base.trainer.n_gpus_per_node) * int(base.trainer.nnodes)
    split = _split_overrides(overrides, devices)
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
        run_dir = os.path.join(out, mode.replace("+", "plus_"))
        extra = MODES[mode] + (split if mode != "colocated" else []) + [f"digen.output_dir={run_dir}"]
        cfg = compose_config(overrides + extra)
        result = run_training(cfg)
        steady = result.metrics[1:] or result.metrics
        step_time = sum(m["step_time_s"] for m in steady)
        images = sum(m["images_per_s"] * m["step_time_s"] for m in steady)
        rows.append(
            Row(
                mode=mode,
                devices=result.devices,
                images_per_s=images / step_time,
                images_per_device_s=images / step_time / result.devices,
                bubble_fraction=sum(m["bubble_fraction"] * m["step_time_s"] for m in steady) / step_time,
                reward_mean_last=result.metrics[-1]["reward_mean"],
                wall_s=result.wall_s,
                step_time_s=step_time / len(steady),
                weight_sync_s=sum(m["weight_sync_s"] for m in steady) / len(steady),
                max_staleness_seen=max(m["max_staleness_seen"] for m in result.metrics),
                output_dir=result.output_dir,
            )
        )
    return rows


def format_table(rows: list[Row]) -> str:
    base = next((r for r in rows if r.mode == "colocated"), rows[0])
    lines = [
        f"{'mode':<14} {'devices':>7} {'images/s':>9} {'vs coloc':>8} {'bubble':>7} {'step s':>7} "
        f"{'sync s':>7} {'stale':>5} {'reward(last)':>12} {'wall s':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r.mode:<14} {r.devices:>7} {r.images_per_s:>9.2f} {r.images_per_s / base.images_per_s:>7.2f}x "
            f"{r.bubble_fraction:>7.3f} {r.step_time_s:>7.3f} {r.weight_sync_s:>7.4f} {r.max_staleness_seen:>5} "
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
