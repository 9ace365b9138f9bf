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

**Time to target** (``--target-reward T``): users pick a system by how fast it reaches a
reward, not by images/s alone (one-step staleness may buy throughput and cost learning). For
each mode the table then gains, for two readings of "the reward":

- ``val``: the validation reward (``val/reward_mean``: held-out prompts, deterministic ODE
  samples, every ``trainer.test_freq`` steps, and before training with
  ``trainer.val_before_train=true``);
- ``ma``: the moving average of the training reward (``reward_mean``) over the last
  ``--target-window`` steps (a full window only);

the wall seconds and the images trained on until it first reaches ``T`` (empty when it never
does). Wall seconds count from the start of the first training step (model loading and Ray
start-up excluded, validation included) to the end of the optimizer step where the target is
first met, read from the run's timeline; images = steps x images per step. Also writes
``DIR/reward_vs_time.png`` (both readings against wall seconds, per mode, with the target).
A preset other than the default is picked as for the main job: ``--config-name digits``.

Every mode starts fresh (``trainer.resume_mode=disable``, checkpoints under its own run
directory). ``--resume`` reuses the modes that an earlier, stopped compare with the same
arguments finished (their ``compare_row.json``), and runs the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
class TargetResult:
    """When a run first reached the target reward (None: never), by one reading of the reward."""

    step: int | None
    wall_s: float | None
    images: int | None


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
    images_per_step: int = 0
    reward_ma_last: float | None = None  # moving average of reward_mean over the last --target-window steps
    val_reward_first: float | None = None  # before training (trainer.val_before_train) or at the first validation
    val_reward_last: float | None = None
    target_reward: float | None = None
    target_val: TargetResult | None = None
    target_ma: TargetResult | None = None
    # Per step: [step, wall_s, reward_mean, moving average or None, val/reward_mean or None]; step 0 = before training.
    curve: list[list] | None = None


# ---------------------------------------------------------------------------- time to target


def step_end_times(timeline: list[dict]) -> dict[int, float]:
    """Training step (1-based, as in metrics.jsonl) -> seconds from the run's start to the end of
    its optimizer step, from ``timeline.jsonl`` records (the last rank to finish, under FSDP)."""
    ends: dict[int, float] = {}
    for r in timeline:
        if r["kind"] == "optimizer_step":
            step = int(r["step"]) + 1
            ends[step] = max(ends.get(step, 0.0), float(r["end"]))
    return ends


def moving_average(values: list[float], window: int) -> list[float | None]:
    """Trailing mean over ``window`` values; None until a full window is in."""
    if window < 1:
        raise ValueError(f"--target-window must be >= 1, got {window}")
    out: list[float | None] = []
    for i in range(len(values)):
        out.append(sum(values[i + 1 - window : i + 1]) / window if i + 1 >= window else None)
    return out


def first_reaching(points: list[tuple[int, float | None]], target: float) -> int | None:
    """The first step of ``(step, value)`` points (in step order) whose value is >= ``target``."""
    for step, value in points:
        if value is not None and value >= target:
            return step
    return None


def reward_curve(
    metrics: list[dict], ends: dict[int, float], window: int, val_before: float | None = None
) -> list[list]:
    """``[step, wall_s, reward_mean, moving average, val]`` rows (see :attr:`Row.curve`)."""
    ma = moving_average([m["reward_mean"] for m in metrics], window)
    rows: list[list] = [[0, 0.0, None, None, val_before]] if val_before is not None else []
    for m, avg in zip(metrics, ma):
        step = int(m["step"])
        if step not in ends:
            raise ValueError(f"the timeline has no optimizer step for step {step}")
        rows.append([step, ends[step], m["reward_mean"], avg, m.get("val/reward_mean")])
    return rows


def time_to_target(curve: list[list], target: float, images_per_step: int) -> tuple[TargetResult, TargetResult]:
    """``(by validation reward, by moving-average reward)`` for a :func:`reward_curve`."""
    wall = {row[0]: row[1] for row in curve}
    results = []
    for column in (4, 3):
        step = first_reaching([(row[0], row[column]) for row in curve], target)
        if step is None:
            results.append(TargetResult(None, None, None))
        else:
            results.append(TargetResult(step, wall[step], step * images_per_step))
    return results[0], results[1]


def _pool_split(overrides: list[str], devices: int, base=None) -> tuple[list[str], int, int]:
    """Pool sizes for the disaggregated modes: the user's, or half and half."""
    from verl_digen.config.compose import compose_config

    if any(o.startswith("digen.pools.") for o in overrides):
        cfg = base if base is not None else compose_config(overrides)
        r, t = cfg.digen.pools.rollout, cfg.digen.pools.trainer
        return [], r.devices * (r.nodes or 1), t.devices * (t.nodes or 1)
    rollout = max(1, devices // 2)
    trainer = max(1, devices - rollout)
    return [f"digen.pools.rollout.devices={rollout}", f"digen.pools.trainer.devices={trainer}"], rollout, trainer


def reward_pool_overrides(reward_devices: int, devices: int, nnodes: int) -> list[str]:
    """A reward pool of ``reward_devices`` workers for the disaggregated modes, on top of the
    ``devices`` the colocated mode runs on (one node: its device count grows by as many)."""
    if not reward_devices:
        return []
    if reward_devices < 0 or nnodes != 1:
        raise SystemExit(f"--reward-devices {reward_devices}: needs a count >= 0 and one node (trainer.nnodes={nnodes})")
    return [f"digen.pools.reward.devices={reward_devices}", f"trainer.n_gpus_per_node={devices + reward_devices}"]


def run_modes(
    out: str,
    overrides: list[str],
    modes: list[str],
    *,
    config_name: str | None = None,
    config_dir: str | None = None,
    target_reward: float | None = None,
    target_window: int = 10,
    resume: bool = False,
    reward_devices: int = 0,
) -> list[Row]:
    """Run every mode (see the module docstring). Each finished mode writes its row to
    ``<run dir>/compare_row.json``; with ``resume``, a mode whose row was written by a run of the
    same config, overrides and ``target_window`` is read back instead of run again (a compare that
    was stopped part-way continues where it stopped; the reused rows keep their own timings).

    ``reward_devices``: the disaggregated modes also get a reward pool of that many workers, on
    top of the devices colocated runs on (``trainer.n_gpus_per_node`` grows by as many; one node
    only): they score while rollout generates, which pays when the reward is a remote judge that
    takes time (the colocated workers score what they generate, and wait for it)."""
    from verl_digen.config.compose import CONFIG_DIR, CONFIG_NAME
    from verl_digen.config.compose import compose_config as _compose
    from verl_digen.trainer.loop import run_training

    def compose_config(ovr: list[str]):
        return _compose(ovr, config_name=config_name or CONFIG_NAME, config_dir=config_dir or CONFIG_DIR)

    if target_window < 1:
        raise SystemExit(f"--target-window must be >= 1, got {target_window}")
    rows: list[Row] = []
    base = compose_config(overrides)
    devices = int(base.trainer.n_gpus_per_node) * int(base.trainer.nnodes)
    split, n_roll, n_train = _pool_split(overrides, devices, base)
    split = split + reward_pool_overrides(reward_devices, devices, int(base.trainer.nnodes))
    for mode in modes:
        mode_ovr = mode_overrides(mode, n_roll, n_train)
        if mode_ovr is None:
            print(f"[verl-digen] compare: skipping {mode}: TSP needs >= 2 rollout devices (have {n_roll})")
            continue
        run_dir = os.path.join(out, mode.replace("+", "plus_"))
        # Each mode checkpoints into its own run directory: with trainer.resume_mode=auto, a shared
        # default_local_dir would let one mode resume from another's (e.g. a stopped run's) checkpoint.
        # A compare always starts each mode fresh (never resumes a checkpoint).
        extra = mode_ovr + (split if mode != "colocated" else []) + [
            f"digen.output_dir={run_dir}", f"trainer.default_local_dir={os.path.join(run_dir, 'checkpoints')}",
            "trainer.resume_mode=disable"]
        key = {"config_name": config_name, "config_dir": config_dir, "overrides": list(overrides),
               "mode_overrides": mode_ovr + (split if mode != "colocated" else []), "target_window": target_window}
        row_file = os.path.join(run_dir, "compare_row.json")
        if resume and os.path.isfile(row_file):
            with open(row_file) as f:
                saved = json.load(f)
            if saved.get("key") == key:
                print(f"[verl-digen] compare: reusing {mode} from {row_file}")
                rows.append(_row_from_dict(saved["row"], target_reward))
                continue
        cfg = compose_config(overrides + extra)
        result = run_training(cfg)
        steady = result.metrics[1:] or result.metrics
        step_time = sum(m["step_time_s"] for m in steady)
        images = sum(m["images_per_s"] * m["step_time_s"] for m in steady)

        def weighted(key: str) -> float:
            return sum(m[key] * m["step_time_s"] for m in steady) / step_time

        with open(os.path.join(result.output_dir, "timeline.jsonl")) as f:
            timeline = [json.loads(line) for line in f if line.strip()]
        val_before = (result.extra.get("val_before_train") or {}).get("val/reward_mean")
        curve = reward_curve(result.metrics, step_end_times(timeline), target_window, val_before)
        vals = [row[4] for row in curve if row[4] is not None]
        images_per_step = int(cfg.digen.batch.groups_per_step) * int(cfg.digen.batch.group_size)
        target_val = target_ma = None
        if target_reward is not None:
            target_val, target_ma = time_to_target(curve, target_reward, images_per_step)
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
                images_per_step=images_per_step,
                reward_ma_last=curve[-1][3],
                val_reward_first=vals[0] if vals else None,
                val_reward_last=vals[-1] if vals else None,
                target_reward=target_reward,
                target_val=target_val,
                target_ma=target_ma,
                curve=curve,
            )
        )
        with open(row_file, "w") as f:
            json.dump({"key": key, "row": dataclasses.asdict(rows[-1])}, f)
    return rows


def _row_from_dict(data: dict, target_reward: float | None) -> Row:
    """A :class:`Row` read back from ``compare_row.json``, its time to target recomputed for
    ``target_reward`` from its curve."""
    row = Row(**{**data, "target_val": None, "target_ma": None, "target_reward": target_reward})
    if target_reward is not None and row.curve:
        row.target_val, row.target_ma = time_to_target(row.curve, target_reward, row.images_per_step)
    return row


def _fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row]) -> str:
    base = next((r for r in rows if r.mode == "colocated"), rows[0])
    targets = any(r.target_reward is not None for r in rows)
    header = (
        f"{'mode':<14} {'devices':>7} {'images/s':>9} {'vs coloc':>8} {'bubble':>7} {'head':>6} {'drain':>6} "
        f"{'step s':>7} {'sync s':>7} {'stale':>5} {'reward(last)':>12} {'wall s':>7}"
    )
    if targets:
        header += f" {'ma(last)':>8} {'val(last)':>9} {'val: s':>7} {'images':>7} {'ma: s':>7} {'images':>7}"
    lines = [header]
    for r in rows:
        line = (
            f"{r.mode:<14} {r.devices:>7} {r.images_per_s:>9.2f} {r.images_per_s / base.images_per_s:>7.2f}x "
            f"{r.bubble_fraction:>7.3f} {r.head_bubble:>6.3f} {r.drain_bubble:>6.3f} "
            f"{r.step_time_s:>7.3f} {r.weight_sync_s:>7.4f} {r.max_staleness_seen:>5} "
            f"{r.reward_mean_last:>12.4f} {r.wall_s:>7.1f}"
        )
        if targets:
            tv = r.target_val or TargetResult(None, None, None)
            tm = r.target_ma or TargetResult(None, None, None)
            line += (
                f" {_fmt(r.reward_ma_last, '.4f'):>8} {_fmt(r.val_reward_last, '.4f'):>9}"
                f" {_fmt(tv.wall_s, '.1f'):>7} {_fmt(tv.images, 'd'):>7}"
                f" {_fmt(tm.wall_s, '.1f'):>7} {_fmt(tm.images, 'd'):>7}"
            )
        lines.append(line)
    if targets:
        window = next((r for r in rows if r.target_reward is not None))
        lines.append(
            f"time to target reward {window.target_reward}: 'val: s' / 'images' = wall seconds / images trained on "
            "until the validation reward first reaches it, 'ma: s' / 'images' the same for the moving average of "
            "the training reward ('-': not reached)"
        )
    return "\n".join(lines)


def save_reward_plot(rows: list[Row], path: str, target: float | None = None) -> None:
    """Reward against wall seconds per mode: the training reward's moving average (line) and the
    validation reward (markers), with the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, r in enumerate(rows):
        color = f"C{i}"
        curve = r.curve or []
        ma = [(row[1], row[3]) for row in curve if row[3] is not None]
        val = [(row[1], row[4]) for row in curve if row[4] is not None]
        if ma:
            ax.plot(*zip(*ma), color=color, label=f"{r.mode} (moving avg)")
        if val:
            ax.plot(*zip(*val), color=color, marker="o", linestyle="--", alpha=0.7, label=f"{r.mode} (validation)")
    if target is not None:
        ax.axhline(target, color="black", linestyle=":", label=f"target {target}")
    ax.set_xlabel("wall seconds (training)")
    ax.set_ylabel("reward")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    parser.add_argument("--config-name", default=None, help="preset to run (as for the main job), e.g. digits")
    parser.add_argument("--config-dir", default=None, help="directory of --config-name (default: the presets, configs/ or the wheel's copy)")
    parser.add_argument("--target-reward", type=float, default=None,
                        help="add time-to-target columns: seconds and images until the reward first reaches this")
    parser.add_argument("--target-window", type=int, default=10,
                        help="steps in the moving average of the training reward (default 10)")
    parser.add_argument("--reward-devices", type=int, default=0,
                        help="give the disaggregated modes a reward pool of this many workers besides the colocated "
                             "run's devices (a remote reward that takes time; one node)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the modes a stopped compare with the same arguments already finished in --out")
    args, overrides = parser.parse_known_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {', '.join(unknown)}; valid: {', '.join(MODES)}")
    if args.target_window < 1:
        parser.error(f"--target-window must be >= 1, got {args.target_window}")
    if args.target_reward is not None and not math.isfinite(args.target_reward):
        parser.error(f"--target-reward must be a finite number, got {args.target_reward}")
    os.makedirs(args.out, exist_ok=True)
    from verl_digen.config.schema import ConfigError

    try:
        rows = run_modes(args.out, overrides, modes, config_name=args.config_name, config_dir=args.config_dir,
                         target_reward=args.target_reward, target_window=args.target_window, resume=args.resume,
                         reward_devices=args.reward_devices)
    except (ConfigError, FileNotFoundError) as e:
        print(f"[verl-digen] error: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
    save_chart(rows, os.path.join(args.out, "compare.png"))
    save_reward_plot(rows, os.path.join(args.out, "reward_vs_time.png"), args.target_reward)
    print(format_table(rows))
    print(f"[verl-digen] summary: {os.path.abspath(os.path.join(args.out, 'summary.json'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
