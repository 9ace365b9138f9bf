"""Our own fixed per-step cost, measured: what a step takes beyond its tasks' work.

The per-step overhead of our controller and workers (dispatch, ``ray.wait``, the object store,
the driver's advantages and bookkeeping, weight syncs, logging, checkpoints amortised) is the
``verl-digen`` system profile's ``step_fixed_s`` (``verl_digen/sim/profiles/systems.yaml``). It is
measured two ways:

- **a real run's timeline** (``timeline.jsonl`` and ``metrics.jsonl`` of a run directory, e.g. the
  tiny CPU run of ``python -m verl_digen.main``): for each steady-state step, the time from its
  first task's start to the next step's first task's start, minus the busiest worker's task
  seconds in the step (:func:`step_overheads`): what no task of that worker accounts for;
- **the emulated runtime** (``--emulate``): the real ``RayPlanExecutor`` drives emulated devices
  (Ray actors that sleep for the cost model's task time) through the best colocated plan of FLUX.1
  at 16 and 32 devices; the emulated steps' real seconds minus the simulated ones, per step, are
  the runtime's own overhead at that scale (the simulator runs the same plan with
  ``step_fixed_s`` 0).

    python benchmarks/step_overhead.py RUN_DIR [RUN_DIR ...]      # timelines of finished runs
    python -m verl_digen.main && python benchmarks/step_overhead.py --latest   # a tiny run, then its timeline
    python benchmarks/step_overhead.py --emulate                  # the emulated runtime at 16 and 32 H800
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from collections import defaultdict
from typing import Any, Iterable

RUNS_GLOB = os.path.join("runs", "verl_digen", "*", "timeline.jsonl")


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def step_overheads(records: Iterable[dict[str, Any]]) -> dict[int, float]:
    """Seconds of each step beyond its busiest worker's tasks: the step's period (its first task's
    start to the next step's first task's start) minus the largest sum of task seconds any one
    worker spent in it. A task on several workers (the optimizer step) counts for each. The last
    step has no next start and is left out."""
    first: dict[int, float] = {}
    busy: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        s = int(r["step"])
        first[s] = min(first.get(s, float("inf")), float(r["start"]))
        for w in r.get("workers") or [r.get("worker")]:
            busy[s][w] += float(r["end"]) - float(r["start"])
    steps = sorted(first)
    return {s: (first[n] - first[s]) - max(busy[s].values()) for s, n in zip(steps, steps[1:])}


def run_overhead(run_dir: str, warmup: int = 1) -> dict[str, Any]:
    """The per-step overhead of a finished run: median and mean over its steps after ``warmup``."""
    per_step = step_overheads(read_jsonl(os.path.join(run_dir, "timeline.jsonl")))
    steady = [v for s, v in sorted(per_step.items()) if s >= warmup]
    if not steady:
        raise ValueError(f"{run_dir}: no step after the first {warmup} with a next step to measure")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    step_s = []
    if os.path.isfile(metrics_path):
        step_s = [m["step_time_s"] for m in read_jsonl(metrics_path) if "step_time_s" in m][warmup:]
    return {"run": run_dir, "steps": len(steady), "median_s": statistics.median(steady), "mean_s": statistics.fmean(steady),
            "max_s": max(steady), "median_step_s": statistics.median(step_s) if step_s else None}


def emulated_overheads(sizes: Iterable[int] = (16, 32), device_type: str = "H800", steps: int = 3,
                       generate_ms: float = 200.0) -> list[dict[str, Any]]:
    """Per-step real seconds the Ray runtime adds to the best colocated FLUX.1 plan (emulated
    devices) over the simulator on the same plan."""
    import ray

    from verl_digen.emulate import run_emulated_plan
    from verl_digen.schedule.strategies import StepPlanner
    from verl_digen.sim.cost_model import CostModel, load_catalog
    from verl_digen.sim.planner import MECHANISMS, Inventory, search
    from verl_digen.sim.simulator import simulate_plan

    colocated = [m for m in MECHANISMS if MECHANISMS[m]["placement"] == "colocated"]
    catalog = load_catalog()
    costs = CostModel.from_catalog(catalog, "flux-12b", devices=[device_type], system="verl-digen")
    costs = costs.with_system(__import__("dataclasses").replace(costs.system, step_fixed_s=0.0))  # the runtime's own, measured here
    out = []
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for n in sizes:
            ev = search(costs, Inventory({device_type: n}), mechanisms=colocated, micro_batches=(1,), steps=4).best
            spec, cluster = ev.candidate.spec, ev.candidate.cluster
            costs_s = costs.for_spec(spec)
            planner = StepPlanner(spec)
            for s in range(steps):
                planner.plan_step(s, has_next=s + 1 < steps)
            sim = simulate_plan(planner.plan, costs_s, cluster)
            sim_opt = max(r.end for r in sim.timeline.records if r.kind == "optimizer_step")
            gens = [r.end - r.start for r in sim.timeline.records if r.kind == "generate"]
            scale = generate_ms / 1000 / statistics.mean(gens)
            run = run_emulated_plan(planner.plan, costs_s, cluster, group_size=spec.group_size, time_scale=scale, timeout_s=300)
            emu_opt = run.opt_end[max(run.opt_end)]
            per_step = (emu_opt - sim_opt) * scale / steps  # real seconds: the runtime's overhead does not scale
            out.append({"case": f"flux-12b @ {n} {device_type}", "strategy": spec.name, "tasks": len(planner.plan.tasks),
                        "simulated_real_s": sim_opt * scale, "emulated_real_s": emu_opt * scale, "per_step_s": per_step})
            print(f"  emulated flux-12b @ {n} ({spec.name}, {len(planner.plan.tasks)} tasks, {steps} steps): "
                  f"{emu_opt * scale:.2f} s vs simulated {sim_opt * scale:.2f} s -> {per_step:.3f} s per step", flush=True)
    finally:
        ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="run directories (timeline.jsonl, metrics.jsonl)")
    p.add_argument("--latest", action="store_true", help=f"also the newest run under {os.path.dirname(os.path.dirname(RUNS_GLOB))}/")
    p.add_argument("--warmup", type=int, default=1, help="steps left out at the start")
    p.add_argument("--emulate", action="store_true", help="also the emulated runtime at 16 and 32 H800 (Ray)")
    args = p.parse_args(argv)
    runs = list(args.runs)
    if args.latest:
        found = sorted(glob.glob(RUNS_GLOB), key=os.path.getmtime)
        if not found:
            p.error(f"--latest: no {RUNS_GLOB} here: run python -m verl_digen.main first")
        runs.append(os.path.dirname(found[-1]))
    if not runs and not args.emulate:
        p.error("name a run directory, --latest or --emulate")
    values = []
    for r in runs:
        o = run_overhead(r, args.warmup)
        values.append(o["median_s"])
        step = f", median step {o['median_step_s']:.3f} s" if o["median_step_s"] else ""
        print(f"{r}: {o['steps']} steps: per-step overhead median {o['median_s']:.3f} s, mean {o['mean_s']:.3f} s, "
              f"max {o['max_s']:.3f} s{step}")
    if args.emulate:
        values += [e["per_step_s"] for e in emulated_overheads()]
    if values:
        print(f"our per-step overhead: largest median {max(values):.3f} s (verl-digen step_fixed_s in profiles/systems.yaml)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
