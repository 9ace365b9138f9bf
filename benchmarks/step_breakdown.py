"""Where a simulated step's time goes: the best configuration of each mechanism set the planner
finds, and for each its pools' busy device-seconds per step by task kind, the busiest device's
share of the step and the bubble; and the work of one step (device-seconds of all its tasks,
wherever and whenever they ran) spread evenly over every device: the step no split of the
devices between pools can beat with these tasks.

    python benchmarks/step_breakdown.py --model qwen-image-20b --devices 32
    python benchmarks/step_breakdown.py --model hunyuanvideo-13b --devices 32 --timeline trainer0,rollout0

It answers "why does the best disaggregated configuration lose to colocated here": a pool whose
devices are busy the whole step is the bottleneck; equal work per image on both sides then
leaves only the split of devices between the pools (whole groups per rollout worker, micro-batch
rows that must split evenly over lockstep FSDP ranks) to gain from.
"""

from __future__ import annotations

import argparse
import collections
import sys

from verl_digen.sim.cost_model import CostModel, load_catalog
from verl_digen.sim.planner import Inventory, search

DEFAULT_SETS = ("colocated+fsdp", "colocated", "disaggregated+gap+fsdp+tcss", "disaggregated+gap+tcss")


def breakdown(evaluation) -> dict:
    """Busy device-seconds per step of each (pool, task kind) over the measured steps but the
    run's last, with tasks cut at the window's edges."""
    result = evaluation.result
    t0, t1 = result.window
    steps = result.measured_steps
    if steps > 1:
        # Leave the run's last step out: under TCSS the rollout pool generates the next step's
        # groups during a step, and the run plans none past its end, so its last step would show
        # an idle rollout pool that a longer run does not have.
        t1, steps = result.step_end[-2], steps - 1
    busy: dict[tuple[str, str], float] = collections.defaultdict(float)
    per_device: dict[str, float] = collections.defaultdict(float)
    for rec in result.timeline.records:
        start, end = max(rec.start, t0), min(rec.end, t1)
        if end <= start:
            continue
        for worker in rec.workers:
            pool = worker.rstrip("0123456789")
            busy[(pool, rec.kind)] += end - start
            per_device[worker] += end - start
    # One measured step's own tasks, by their step (under TCSS some ran during the step before).
    step = result.warmup_steps
    work = sum((rec.end - rec.start) * len(rec.workers) for rec in result.timeline.records if rec.step == step)
    return {"busy": {k: v / steps for k, v in busy.items()}, "work": work,
            "devices": evaluation.candidate.cluster.devices,  # every device, busy in the window or not
            "busiest": max(per_device.values()) / (t1 - t0) if per_device else 0.0,
            "step_s": result.step_time_s, "images_per_s": result.images_per_s,
            # idle share of the devices over the same steps (the simulator's own bubble_fraction
            # counts the run's last step too)
            "bubble": 1.0 - sum(per_device.values()) / (len(per_device) * (t1 - t0)) if per_device else 0.0,
            "spec": evaluation.candidate.spec}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--device-type", default="H800")
    p.add_argument("--mechanisms", default=",".join(DEFAULT_SETS))
    p.add_argument("--timeline", default="", help="workers whose tasks of one measured step to print, e.g. trainer0,rollout0")
    p.add_argument("--vae-decode-chunk", type=int, default=0,
                   help="samples per VAE decode call (digen.model.vae_decode_chunk; default 0: a generate call's all)")
    args = p.parse_args(argv)
    costs = CostModel.from_catalog(load_catalog(), args.model, devices=[args.device_type], system="verl-digen",
                                   vae_decode_chunk=args.vae_decode_chunk)
    sets = [m.strip() for m in args.mechanisms.split(",") if m.strip()]
    found = search(costs, Inventory({args.device_type: args.devices}, 8), mechanisms=sets)
    colocated = found.colocated_images_per_s
    for label in sets:
        ev = found.best_of(label)
        if ev is None:
            print(f"{label}: no configuration fits")
            continue
        b = breakdown(ev)
        spec = b["spec"]
        pools = "colocated" if spec.placement == "colocated" else f"{spec.rollout_workers} rollout + {spec.trainer_workers} trainer"
        ratio = f", {b['images_per_s'] / colocated:.2f}x colocated" if colocated else ""
        print(f"{label}: {pools}, {spec.groups_per_task} group(s)/task, {spec.train_micro_batch_groups} group(s)/micro-batch: "
              f"{b['images_per_s']:.4g} images/s{ratio}, step {b['step_s']:.1f} s, bubble {b['bubble']:.3f}, "
              f"busiest device busy {100 * b['busiest']:.0f}% of the step")
        for (pool, kind), seconds in sorted(b["busy"].items()):
            n = {"rollout": spec.rollout_workers, "trainer": spec.trainer_workers, "fused": spec.rollout_workers,
                 "reward": spec.reward_workers}.get(pool, 1)
            print(f"  {pool:8s} {kind:15s} {seconds:10.1f} device-s/step  ({seconds / max(n, 1):7.1f} s per device)")
        even = b["work"] / b["devices"]
        images = b["images_per_s"] * b["step_s"]
        ratio = f", {images / even / colocated:.3f}x colocated" if colocated else ""
        print(f"  one step's work {b['work']:.0f} device-s spread evenly over the {b['devices']} devices: "
              f"{even:.1f} s per step, {images / even:.4g} images/s{ratio}")
        if args.timeline:
            ev_result = ev.result
            t0 = ev_result.step_end[ev_result.warmup_steps - 1] if ev_result.warmup_steps else 0.0
            t1 = ev_result.step_end[ev_result.warmup_steps] if len(ev_result.step_end) > ev_result.warmup_steps else t0
            wanted = set(args.timeline.split(","))
            for rec in ev_result.timeline.records:
                if rec.start >= t0 and rec.end <= t1 and wanted & set(rec.workers):
                    print(f"    {rec.workers[0]:10s} {rec.kind:15s} {rec.task:20s} {rec.start - t0:8.1f} -> {rec.end - t0:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
