"""One timeline picture per placement and mechanism, from real tiny runs on the CPU.

    python benchmarks/timeline_pictures.py [--steps 5] [--last 2] [--out runs/timelines] [--only gap,tcss]
    python benchmarks/timeline_pictures.py --from-runs runs/timelines     # re-draw from the runs' timelines

Runs the tiny FLUX model (brightness reward, 8 groups of 4 images per step) once per
configuration below, each with ``python -m verl_digen.main``'s own loop (``run_training``), and
draws the ``--last`` training steps before the final one of each run's ``timeline.jsonl`` (the
final step has no next step to generate ahead, so it does not show TCSS; one row per worker,
one colour per task kind: ``verl_digen.schedule.timeline.save_gantt``) into
``docs/_static/timeline_<name>.png``. ``docs/_static/timelines.json`` records the command, the
commit and each run's steady-state images/s and bubble fraction. The documentation's concepts
page shows the pictures.

- colocated:     2 fused workers: generate, score, train, all-reduce
- disaggregated: 1 rollout + 1 trainer, the whole batch generated before training starts
- gap:           the same with GAP: groups streamed to the trainer as they finish
- tcss:          GAP + TCSS: the next step generated on the previous weights while this one trains
- tsp:           GAP with 2 rollout workers as one 2-stage time-step pipeline + 1 trainer
- tag:           GAP, cheap training (a 2-step SDE window), TAG: the trainer generates a share
- gat:           GAP, dear training (every step trained), GAT: the rollout worker trains a share
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATIC = os.path.join(ROOT, "docs", "_static")

DISAGG = ["digen.placement=disaggregated", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=1"]
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "colocated": ("colocated, 2 workers", []),
    "disaggregated": ("disaggregated, 1 rollout + 1 trainer", DISAGG),
    "gap": ("disaggregated + GAP", DISAGG + ["digen.gap.enable=true"]),
    "tcss": ("disaggregated + GAP + TCSS", DISAGG + ["digen.gap.enable=true", "digen.async.max_staleness=1"]),
    "tsp": ("disaggregated + GAP + TSP (2 stages)",
            ["digen.placement=disaggregated", "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=1",
             "trainer.n_gpus_per_node=3", "digen.tsp.stages=2", "digen.gap.enable=true"]),
    "tag": ("disaggregated + GAP + TAG, cheap training",
            DISAGG + ["digen.gap.enable=true", "digen.sampling.sde_window.mode=fixed",
                      "digen.sampling.sde_window.size=2", "digen.tag.enable=true"]),
    "gat": ("disaggregated + GAP + GAT, dear training",
            DISAGG + ["digen.gap.enable=true", "digen.sampling.sde_window.mode=all", "digen.gat.enable=true"]),
}
COMMON = ["digen.batch.groups_per_step=8", "digen.progress_bar=false", "trainer.logger=[]",
          "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.resume_mode=disable"]


def steps_window(timeline, last: int) -> tuple[float, float, int, int]:
    """``(t0, t1, first, final)``: the ``last`` training steps before the run's final step, from
    the end of the optimizer step before them to the end of theirs."""
    ends: dict[int, float] = {}
    for r in timeline.records:
        if r.kind == "optimizer_step":
            ends[r.step] = max(ends.get(r.step, 0.0), r.end)
    steps = sorted(ends)
    shown = steps[-last - 1:-1] if len(steps) > last else steps
    before = [s for s in steps if s < shown[0]]
    t0 = ends[before[-1]] if before else min(r.start for r in timeline.records)
    return t0, ends[shown[-1]], shown[0], shown[-1]


def draw(name: str, run_dir: str, last: int) -> dict:
    from verl_digen.schedule.timeline import Timeline, save_gantt

    timeline = Timeline.read_jsonl(os.path.join(run_dir, "timeline.jsonl"))
    t0, t1, first, final = steps_window(timeline, last)
    title = f"{CONFIGS[name][0]}, steps {first + 1}-{final + 1}"
    path = os.path.join(STATIC, f"timeline_{name}.png")
    save_gantt(timeline, path, t0=t0, t1=t1, title=title)
    row = {"config": name, "title": title, "picture": os.path.relpath(path, ROOT),
           "bubble_fraction_shown": round(timeline.bubble_fraction(t0, t1), 3)}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            steady = [json.loads(line) for line in f if line.strip()][1:]
        if steady:
            wall = sum(m["step_time_s"] for m in steady)
            row["images_per_s"] = round(sum(m["images_per_s"] * m["step_time_s"] for m in steady) / wall, 2)
            row["bubble_fraction"] = round(sum(m["bubble_fraction"] * m["step_time_s"] for m in steady) / wall, 3)
    print(f"{name:<14} {path}  {row}")
    return row


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no", "verl_digen"],
                               capture_output=True, text=True).stdout.strip()
        return out + ("+local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    parser.add_argument("--last", type=int, default=2, help="training steps each picture shows (before the final one)")
    parser.add_argument("--out", default="runs/timelines", help="the runs' directories (<out>/<name>)")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    parser.add_argument("--from-runs", default=None, help="draw from <dir>/<name>/timeline.jsonl, run nothing")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; valid: {', '.join(CONFIGS)}")
    os.makedirs(STATIC, exist_ok=True)
    rows = []
    for name in names:
        run_dir = os.path.join(args.from_runs or args.out, name)
        if args.from_runs is None:
            from verl_digen.config.compose import compose_config
            from verl_digen.trainer.loop import run_training

            cfg = compose_config(COMMON + CONFIGS[name][1] + [f"trainer.total_training_steps={args.steps}",
                                                             f"digen.output_dir={run_dir}"])
            run_training(cfg)
        rows.append(draw(name, run_dir, args.last))
    record = os.path.join(STATIC, "timelines.json")
    previous = {}
    if os.path.exists(record):
        with open(record) as f:
            previous = {r["config"]: r for r in json.load(f).get("runs", [])}
    previous.update({r["config"]: r for r in rows})
    command = "python benchmarks/timeline_pictures.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(record, "w") as f:
        json.dump({"command": command.strip(), "commit": commit(), "steps": args.steps, "last": args.last,
                   "runs": [previous[n] for n in CONFIGS if n in previous]}, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
