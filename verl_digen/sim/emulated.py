"""An emulated cluster: the real Ray executor driving N workers that sleep instead of compute.

Each :class:`EmulatedWorker` is a Ray actor with the task methods of
:class:`~verl_digen.workers.worker.DiffusionWorker` (``generate``, ``compute_reward``,
``train_micro_batch``, ``optimizer_step``, ``sync_send``, ``sync_recv``, plus the set-up
calls the training loop makes). A call sleeps for the cost model's duration of the task, times
``time_scale``, and returns the smallest data the executor and the loop consume: reward
vectors as tensors, train and optimizer metrics, sync statistics. Weights versions are kept
and checked as the real worker does, and each worker tracks its generate/train mode, so
switches cost what the simulator charges.

So the orchestration code itself (plan building, dispatch, ``ray.wait``, object refs, the
driver's advantage computation, the loop's bookkeeping) runs at 16-32 devices on a laptop, and
its overhead is measured against the simulator on the same plan:

- :func:`run_emulated_plan` runs a given plan with :class:`RayPlanExecutor`;
- :func:`emulated_devices` swaps the training loop's worker groups for emulated ones, so
  ``verl_digen.trainer.loop.run_training`` runs unchanged (hydra config, planner, executor,
  metrics, timeline and Gantt chart);
- ``python -m verl_digen.sim.emulated --model flux-12b --device-type H800 -- <hydra overrides>``
  does the latter and compares each step with the simulator.

Nothing here imports torch at module level: actor processes stay small (tensors are built
when the driver unpickles a reward).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from verl_digen.schedule.plan import Plan, Task, TaskKind, WorkerId
from verl_digen.sim.cost_model import Cluster, CostModel, PoolPlacement


def _as_tensor(values: list, dtype: str) -> Any:
    import torch

    return torch.tensor(values, dtype=getattr(torch, dtype))


class TensorData:
    """A list that becomes a ``torch.Tensor`` when unpickled (on the driver)."""

    def __init__(self, values: list, dtype: str) -> None:
        self.values = values
        self.dtype = dtype

    def __reduce__(self) -> tuple:
        return (_as_tensor, (self.values, self.dtype))


@dataclass(frozen=True)
class EmulatedTrajectories:
    """What an emulated generate returns: which groups, how many rows, which weights version."""

    group_ids: tuple[int, ...]
    group_size: int
    policy_version: int


def emulated_reward(group: int, index: int) -> float:
    """A deterministic reward in [0, 1) per sample (non-constant within a group)."""
    x = (group * 2654435761 + index * 40503 + 12345) % 1_000_003
    return x / 1_000_003


class EmulatedWorker:
    """Sleeps for the cost model's seconds; returns what the executor expects."""

    def __init__(
        self, worker: WorkerId, costs: Any, cluster: Cluster, *, group_size: int, time_scale: float = 1.0
    ) -> None:
        self.worker = worker
        self.costs = costs
        self.cluster = cluster
        self.group_size = group_size
        self.time_scale = time_scale
        self.mode = costs.initial_mode(worker)
        self.policy_version = 0
        self.modelled_s = 0.0  # virtual seconds of work done

    def _work(self, kind: TaskKind, *, groups: tuple[int, ...] = (), step: int = 0, version: int = 0, **fields: Any) -> float:
        task = Task(
            id="emulated", kind=kind, workers=(self.worker,), step=step, groups=groups, version=version,
            images=len(groups) * self.group_size, **fields,
        )
        seconds = self.costs.task_seconds(task, self.worker, self.cluster, switch_from=self.mode)
        after = self.costs.mode_of(task, self.worker)
        if after is not None:
            self.mode = after
        self.modelled_s += seconds
        time.sleep(seconds * self.time_scale)
        return seconds

    # ------------------------------------------------------------------ set-up (the loop's calls)

    def init_model(self) -> dict[str, Any]:
        self.warm_up()
        return {"role": self.worker.pool, "rank": self.worker.rank, "emulated": True}

    def warm_up(self) -> str:
        """Trainers import torch now: the driver sends them advantages as tensors (a real
        worker has torch loaded from the start; the first train call should not pay for it)."""
        if self.worker.pool in ("trainer", "fused"):
            import torch  # noqa: F401

        return str(self.worker)

    def sync_master_endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def sync_open(self, *args: Any, **kwargs: Any) -> None:
        return None

    def weights_digest(self) -> str:
        return "emulated"

    def ping(self) -> str:
        return str(self.worker)

    def get_policy_version(self) -> int:
        return self.policy_version

    def modelled_seconds(self) -> float:
        return self.modelled_s

    # ------------------------------------------------------------------ tasks

    def generate(self, request: dict[str, Any], *previous_stage: EmulatedTrajectories) -> EmulatedTrajectories:
        """Whole groups, or one TSP stage (``request["denoise"]``) continuing ``previous_stage``."""
        if request["version"] != self.policy_version:
            raise RuntimeError(
                f"{self.worker} holds weights version {self.policy_version} but the plan generates groups "
                f"{request['group_ids']} with version {request['version']}"
            )
        groups = tuple(request["group_ids"])
        fields: dict[str, Any] = {}
        denoise = request.get("denoise")
        if denoise is not None:
            total = getattr(getattr(self.costs, "workload", None), "num_steps", denoise[1])
            fields = {"denoise": tuple(denoise), "final": denoise[1] >= total}
        self._work(TaskKind.GENERATE, groups=groups, step=request["step"], version=request["version"], **fields)
        return EmulatedTrajectories(groups, self.group_size, self.policy_version)

    def profile_step_costs(self) -> dict[str, Any]:
        """What TSP's stage balancing asks a rollout worker (modelled, not measured)."""
        if hasattr(self.costs, "step_profile"):
            return self.costs.step_profile(self.costs.device(self.cluster.device_of(self.worker)), self.group_size)
        steps = getattr(getattr(self.costs, "workload", None), "num_steps", 8)
        return {"step_s": [1.0] * steps, "head_s": 0.0, "tail_s": 0.0}

    def compute_reward(self, data: EmulatedTrajectories) -> dict[str, Any]:
        self._work(TaskKind.REWARD, groups=data.group_ids)
        rows = [(g, i) for g in data.group_ids for i in range(data.group_size)]
        return {
            "group_id": TensorData([g for g, _ in rows], "int64"),
            "rewards": TensorData([emulated_reward(g, i) for g, i in rows], "float32"),
            "policy_version": TensorData([data.policy_version] * len(rows), "int64"),
        }

    def train_micro_batch(self, request: dict[str, Any], *trajectories: EmulatedTrajectories) -> dict[str, float]:
        groups = tuple(request["groups"])
        versions = [t.policy_version for t in trajectories if set(t.group_ids) & set(groups)]
        if not versions:
            raise KeyError(f"groups {groups} are in none of the trajectories passed to {self.worker}")
        part = request.get("train_part")
        seconds = self._work(TaskKind.TRAIN, groups=groups, **({"train_part": tuple(part)} if part else {}))
        return {
            "actor/loss": 0.0,
            "actor/emulated_s": seconds,
            "staleness_max": float(self.policy_version - min(versions)),
            "staleness_min": float(self.policy_version - max(versions)),
        }

    def optimizer_step(self) -> dict[str, float]:
        self._work(TaskKind.OPTIMIZER_STEP)
        self.policy_version += 1
        return {"actor/grad_norm": 0.0, "actor/lr": 0.0, "actor/skipped_nonfinite": 0.0, "policy_version": float(self.policy_version)}

    def _sync_stats(self, version: int, seconds: float) -> dict[str, Any]:
        nbytes = int(getattr(self.costs, "sync_bytes", 0))
        return {"version": version, "nbytes": nbytes, "seconds": seconds * self.time_scale, "num_tensors": 0}

    def sync_send(self, version: int) -> dict[str, Any]:
        seconds = self._work(TaskKind.SYNC, version=version)
        self.policy_version = version
        return self._sync_stats(version, seconds)

    def sync_recv(self) -> dict[str, Any]:
        seconds = self._work(TaskKind.SYNC)
        self.policy_version += 1  # syncs deliver versions in order
        return self._sync_stats(self.policy_version, seconds)


# ---------------------------------------------------------------------------- driver side


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

    def step_times(self) -> list[float]:
        ends = [self.opt_end[s] for s in sorted(self.opt_end)]
        return [b - a for a, b in zip([0.0] + ends, ends)]


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
    finally:
        kill_actors(actors)
    timeline = _rescale(executor.timeline, t0, time_scale)
    opt_end = {r.step: r.end for r in timeline.records if r.kind == TaskKind.OPTIMIZER_STEP.value}
    return EmulatedRun(plan=plan, timeline=timeline, makespan=wall / time_scale, wall_s=wall, time_scale=time_scale, opt_end=opt_end)


# ---------------------------------------------------------------------------- the training loop


class _EmulatedGroup:
    """Stands in for a RayWorkerGroup: the loop reads ``.workers`` (and the placement groups of
    ``.resource_pool``, none here)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.resource_pool = None


def cluster_for_layout(layout: Any, device: str) -> Cluster:
    """The :class:`Cluster` of a loop's ``PoolLayout`` (pools of ``devices x nodes``)."""
    pools = {}
    for name, (process_on_nodes, _accel) in layout.pools.items():
        pools[name] = PoolPlacement(size=sum(process_on_nodes), nodes=len(process_on_nodes), device=device)
    return Cluster(pools)


def build_emulated_worker_groups(
    layout: Any, costs: Any, *, device: str, time_scale: float, group_size: int
) -> tuple[dict[str, Any], dict[WorkerId, Any]]:
    """Emulated stand-ins for :func:`verl_digen.placement.pools.build_worker_groups`."""
    import ray

    cluster = cluster_for_layout(layout, device)
    remote = ray.remote(num_cpus=0)(EmulatedWorker)
    groups, actors = {}, {}
    for pool, (process_on_nodes, _accel) in layout.pools.items():
        ranks = [WorkerId(pool, r) for r in range(sum(process_on_nodes))]
        handles = [remote.remote(w, costs, cluster, group_size=group_size, time_scale=time_scale) for w in ranks]
        groups[pool] = _EmulatedGroup(handles)
        actors.update(zip(ranks, handles))
    return groups, actors


def emulation_costs(model: str, device: str) -> Any:
    """The cost model an emulated run sleeps by (``digen.emulate.model`` on ``device_type``)."""
    from verl_digen.sim.cost_model import load_catalog

    return CostModel.from_catalog(load_catalog(), model, devices=[device])


@contextlib.contextmanager
def emulated_devices(costs: Any, *, device: str, time_scale: float = 1.0) -> Iterator[dict[str, Any]]:
    """Inside this context ``verl_digen.trainer.loop`` builds emulated workers instead of
    ``DiffusionWorker`` groups; everything else in the loop runs as usual (the config switch
    ``digen.emulate.model=...`` does the same without a context).

    Yields a dict that receives ``cluster`` and ``actors`` once the loop has built them."""
    import verl_digen.trainer.loop as loop

    state: dict[str, Any] = {}
    original = loop.build_worker_groups

    def build(layout: Any, *, config: Any, model_path: str, use_gpu: bool, num_threads: int):
        groups, actors = build_emulated_worker_groups(
            layout, costs, device=device, time_scale=time_scale, group_size=config.batch.group_size
        )
        state.update(cluster=cluster_for_layout(layout, device), actors=actors)
        return groups, actors

    loop.build_worker_groups = build
    try:
        yield state
    finally:
        loop.build_worker_groups = original


# ---------------------------------------------------------------------------- CLI


def _step_table(real: list[dict], simulated: list[dict], time_scale: float) -> list[str]:
    lines = [f"{'step':>4} {'emulated s':>11} {'simulated s':>12} {'gap':>7}"]
    for r, s in zip(real, simulated):
        e = r["step_time_s"] / time_scale
        lines.append(f"{r['step']:>4} {e:>11.3f} {s['step_time_s']:>12.3f} {100 * (e / s['step_time_s'] - 1):>6.1f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.sim.emulated",
        description="Run the real training loop on emulated devices timed by the cost model, and compare with the simulator.",
    )
    parser.add_argument("--model", default="flux-12b", help="model profile (see python -m verl_digen.plan --list)")
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
    )
    cluster = cluster_for_layout(trainer.layout, args.device_type)
    if args.time_scale is None:
        gen = costs.step_costs(spec, cluster).generate_per_group * spec.groups_per_task
        args.time_scale = 0.2 / max(gen, 1e-9)
    with emulated_devices(costs, device=args.device_type, time_scale=args.time_scale):
        result = trainer.run()
    sim = simulate(spec, costs, cluster, steps=trainer.total_steps, warmup=min(1, trainer.total_steps - 1), mirror_loop=True)
    print(f"[verl-digen] emulated {spec.name} on {spec.devices} x {args.device_type} ({args.model}), "
          f"time scale {args.time_scale:.3g} real s per modelled s")
    for line in _step_table(result.metrics, sim.step_metrics, args.time_scale):
        print(line)
    real = sum(m["step_time_s"] for m in result.metrics[1:]) / args.time_scale
    virt = sum(m["step_time_s"] for m in sim.step_metrics[1:])
    if virt > 0:
        n_tasks = len(sim.plan.tasks) / max(trainer.total_steps, 1)
        print(f"steps 2..{trainer.total_steps}: emulated {real:.2f} s vs simulated {virt:.2f} s (modelled seconds): "
              f"runtime overhead {100 * (real / virt - 1):.1f}% "
              f"= {1000 * (real - virt) * args.time_scale / max(trainer.total_steps - 1, 1) / n_tasks:.2f} ms per task")
    return 0


if __name__ == "__main__":
    sys.exit(main())
