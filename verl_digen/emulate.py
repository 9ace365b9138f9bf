"""``python -m verl_digen.emulate``: the real Ray executor and training loop on emulated devices.

The workers (:class:`~verl_digen.workers.emulated.EmulatedWorker`) sleep for the cost model's
seconds instead of computing, so the orchestration itself (plan building, dispatch,
``ray.wait``, object refs, the driver's bookkeeping) runs at 16-32 devices on one machine:

- :func:`run_emulated_plan` runs a given plan with :class:`RayPlanExecutor`;
- the CLI runs the training loop with the emulated worker-group factory and compares each
  step with the simulator (the same step driver in virtual time)::

    python -m verl_digen.emulate --model flux-12b --device-type H800 -- <hydra overrides>
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from verl_digen.schedule.plan import Plan, TaskKind, WorkerId
from verl_digen.sim.cost_model import Cluster, CostModel
from verl_digen.workers.emulated import EmulatedWorker, cluster_for_layout, emulated_worker_groups


def start_actors(
    workers: list[WorkerId], costs: Any, cluster: Cluster, *, group_size: int, time_scale: float
) -> dict[WorkerId, Any]:
    """One emulated actor per worker (no CPU reserved: they only sleep)."""
    import ray

    remote = ray.remote(num_cpus=0)(EmulatedWorker)
    return {
        w: remote.options(name=None).remote(w, costs, cluster, group_size=group_size, time_scale=time_scale)
        for w in workers
    }


def kill_actors(actors: dict[WorkerId, Any]) -> None:
    import ray

    for a in actors.values():
        ray.kill(a, no_restart=True)


@dataclass
class EmulatedRun:
    """A run of the real executor on emulated workers, its times in virtual seconds."""

    plan: Plan
    timeline: Any  # Timeline, times in virtual seconds from the first launch
    makespan: float  # virtual seconds
    wall_s: float  # real seconds
    time_scale: float
    opt_end: dict[int, float] = field(default_factory=dict)
    # each worker's (kind, groups, modelled seconds) per task, as it charged them (EmulatedWorker.charged)
    charges: dict[str, list[tuple[str, tuple[int, ...], float]]] = field(default_factory=dict)


def _rescale(timeline: Any, t0: float, scale: float) -> Any:
    from verl_digen.schedule.timeline import TaskRecord, Timeline

    out = Timeline(workers=list(timeline.workers))
    for r in timeline.records:
        out.add(
            TaskRecord(
                task=r.task, kind=r.kind, workers=r.workers, start=(r.start - t0) / scale, end=(r.end - t0) / scale,
                step=r.step, version=r.version, groups=r.groups, extra=r.extra,
            )
        )
    return out


def run_emulated_plan(
    plan: Plan,
    costs: Any,
    cluster: Cluster,
    *,
    group_size: int,
    time_scale: float = 1.0,
    timeout_s: float = 60.0,
) -> EmulatedRun:
    """Run every task of ``plan`` with the real :class:`RayPlanExecutor` on emulated workers.

    Ray must be initialised by the caller (``num_cpus`` does not matter: actors reserve none).
    """
    from verl_digen.trainer.ray_executor import RayPlanExecutor

    actors = start_actors(plan.workers, costs, cluster, group_size=group_size, time_scale=time_scale)
    try:
        import ray

        ray.get([a.warm_up.remote() for a in actors.values()], timeout=timeout_s)  # started, before the clock
        executor = RayPlanExecutor(plan, actors, std_mode="group", timeout_s=timeout_s)
        for t in plan.of_kind(TaskKind.GENERATE):
            for g in t.groups:
                executor.prompts[g] = (g, f"prompt {g}")
        t0 = time.time()
        executor.run_until(None)
        wall = time.time() - t0
        charges = dict(zip(map(str, actors), ray.get([a.charges.remote() for a in actors.values()], timeout=timeout_s)))
    finally:
        kill_actors(actors)
    timeline = _rescale(executor.timeline, t0, time_scale)
    opt_end = {r.step: r.end for r in timeline.records if r.kind == TaskKind.OPTIMIZER_STEP.value}
    return EmulatedRun(plan=plan, timeline=timeline, makespan=wall / time_scale, wall_s=wall, time_scale=time_scale,
                       opt_end=opt_end, charges=charges)



def _step_table(real: list[dict], simulated: list[dict], time_scale: float) -> list[str]:
    lines = [f"{'step':>4} {'emulated s':>11} {'simulated s':>12} {'gap':>7}"]
    for r, s in zip(real, simulated):
        e = r["step_time_s"] / time_scale
        lines.append(f"{r['step']:>4} {e:>11.3f} {s['step_time_s']:>12.3f} {100 * (e / s['step_time_s'] - 1):>6.1f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.emulate",
        description="Run the real training loop on emulated devices timed by the cost model, and compare with the simulator.",
    )
    parser.add_argument("--model", default="flux-12b", help="model profile (see python -m verl_digen.sim.planner --list)")
    parser.add_argument("--device-type", default="H800")
    parser.add_argument("--profile", action="append", default=[], help="extra profile YAML (repeatable)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="real seconds per modelled second (default: ~200 ms for the mean generate task)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for the training loop (after --)")
    args = parser.parse_args(argv)

    from verl_digen.config.compose import compose_config
    from verl_digen.sim.cost_model import load_catalog
    from verl_digen.sim.simulator import simulate
    from verl_digen.trainer.loop import DigenTrainer

    # emulated workers hold no weights: no checkpoints
    overrides = ["digen.progress_bar=false", "trainer.logger=[console]", "trainer.save_freq=-1", "trainer.resume_mode=disable",
                 *args.overrides]
    config = compose_config(overrides)
    trainer = DigenTrainer(config)
    spec = trainer.spec
    catalog = load_catalog(args.profile)
    costs = CostModel.from_catalog(
        catalog, args.model, devices=[args.device_type], group_size=spec.group_size, groups_per_step=spec.groups_per_step
    ).for_spec(spec)  # the run's transformer calls and sharding
    cluster = cluster_for_layout(trainer.job.layout, args.device_type)
    if args.time_scale is None:
        gen = costs.step_costs(spec, cluster).generate_per_group * spec.groups_per_task
        args.time_scale = 0.2 / max(gen, 1e-9)
    trainer.worker_groups = emulated_worker_groups(
        costs, device=args.device_type, time_scale=args.time_scale, group_size=spec.group_size
    )
    trainer.emulation = (costs, args.device_type, args.time_scale)  # the deadlines follow what the workers sleep
    result = trainer.run()
    job = trainer.job
    sim = simulate(spec, costs, cluster, steps=job.total_steps, warmup=min(1, job.total_steps - 1),
                   mirror_loop=True, tag_switch_s=job.cfg.tag.switch_cost_s, tsp_balance=job.cfg.tsp.balance,
                   gat_micro_batches=job.cfg.gat.fixed, tag_groups=job.cfg.tag.fixed)
    print(f"[verl-digen] emulated {spec.name} on {spec.devices} x {args.device_type} ({args.model}), "
          f"time scale {args.time_scale:.3g} real s per modelled s")
    for line in _step_table(result.metrics, sim.step_metrics, args.time_scale):
        print(line)
    real = sum(m["step_time_s"] for m in result.metrics[1:]) / args.time_scale
    virt = sum(m["step_time_s"] for m in sim.step_metrics[1:])
    if virt > 0:
        n_tasks = len(sim.plan.tasks) / max(job.total_steps, 1)
        print(f"steps 2..{job.total_steps}: emulated {real:.2f} s vs simulated {virt:.2f} s (modelled seconds): "
              f"runtime overhead {100 * (real / virt - 1):.1f}% "
              f"= {1000 * (real - virt) * args.time_scale / max(job.total_steps - 1, 1) / n_tasks:.2f} ms per task")
    return 0


if __name__ == "__main__":
    sys.exit(main())
