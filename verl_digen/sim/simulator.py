"""The discrete-event executor: the plans the Ray executor runs, in virtual time.

:class:`SimulatedExecutor` is a :class:`~verl_digen.schedule.runner.PlanRunner` whose clock
is virtual: launching a task schedules its end at ``now + duration`` (the cost model's
seconds, the longest member for a gang), and waiting pops the earliest end. Dispatch
order, queues, gangs and dependencies are the runner's, shared with the Ray executor, so
the simulator cannot schedule anything the real executor would not.

Each worker carries a mode (generating or training); a task that needs the other mode pays
the cost model's switch (colocated workers twice per step; trainers that assist generation).
Durations are fixed when a task starts; for devices that share one machine (CPU slots, a
profile's ``host_contention``) they grow with the number of other devices busy at that moment.

:func:`simulate` drives a strategy with the training loop's own
:class:`~verl_digen.schedule.driver.StepDriver` (plan one step, run it to its optimizer step,
re-measure the costs from the timeline, plan the next) and reports the loop's metrics for the
steady-state steps: images/s, images/device/s, step time, bubble fraction, and the zero-bubble
bound next to them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Protocol

from verl_digen.schedule.driver import StepDriver
from verl_digen.schedule.elastic import balanced_spec
from verl_digen.schedule.plan import Plan, Task, TaskId, WorkerId
from verl_digen.schedule.runner import PlanRunner
from verl_digen.schedule.strategies import StepCosts, StrategySpec
from verl_digen.schedule.timeline import Timeline, save_gantt
from verl_digen.sim.cost_model import Cluster


class TaskCoster(Protocol):
    """What the simulator and the emulated workers need from a cost model."""

    def task_seconds(
        self, task: Task, worker: WorkerId, cluster: Cluster, *, switch_from: str | None = None
    ) -> float: ...

    # Optional: True when task_seconds (and contention_factor) depend on a worker only through
    # its pool and device type, so the simulator costs a gang's alike members once.
    # alike_by_pool_and_device: bool

    def mode_of(self, task: Task, worker: WorkerId) -> str | None: ...

    def initial_mode(self, worker: WorkerId) -> str: ...

    def step_costs(self, spec: StrategySpec, cluster: Cluster) -> StepCosts: ...

    def zero_bubble_bound(self, devices: list[str]) -> float: ...


class SimulatedExecutor(PlanRunner):
    """Runs a plan in virtual time; durations come from ``costs.task_seconds``."""

    def __init__(self, plan: Plan, costs: TaskCoster, cluster: Cluster) -> None:
        super().__init__(plan)
        self.costs = costs
        self.cluster = cluster
        self.mode: dict[WorkerId, str] = {w: costs.initial_mode(w) for w in plan.workers}
        self._t = 0.0
        self._seq = 0
        self._events: list[tuple[float, int, TaskId]] = []
        self._switched: dict[TaskId, list[str]] = {}
        self._pending: list[Task] = []  # launched this instant, durations not fixed yet

    def now(self) -> float:
        return self._t

    def _launch(self, task: Task) -> None:
        # Fixed in _wait_one, once every task of this instant is launched: contention between
        # devices of one machine must see all of them.
        self._pending.append(task)

    def _start(self, task: Task) -> None:
        contention = getattr(self.costs, "contention_factor", None)
        busy_others = len(self._busy) - len(task.workers)
        # A gang's members of one pool, device type and mode take the same time under a cost
        # model that says so (a colocated FSDP gang: every device of the cluster): cost it once.
        alike = getattr(self.costs, "alike_by_pool_and_device", False) and self.cluster is not None
        seconds: dict = {}  # by (pool, device type, mode) when alike, else by worker
        duration = 0.0
        for w in task.workers:
            before = self.mode[w]
            key = (w.pool, self.cluster.device_of(w), before) if alike else w
            d = seconds.get(key)
            if d is None:
                d = self.costs.task_seconds(task, w, self.cluster, switch_from=before)
                if contention is not None:
                    d *= contention(w, self.cluster, busy_others)
                seconds[key] = d
            duration = max(duration, d)
            after = self.costs.mode_of(task, w)
            if after is not None and after != before:
                self.mode[w] = after
                self._switched.setdefault(task.id, []).append(str(w))
        self._seq += 1
        heapq.heappush(self._events, (self._t + duration, self._seq, task.id))

    def _wait_one(self) -> tuple[TaskId, Any]:
        for task in self._pending:
            self._start(task)
        self._pending.clear()
        t, _, tid = heapq.heappop(self._events)
        self._t = t
        return tid, None

    def _record_extra(self, task: Task, result: Any) -> dict[str, Any]:
        switched = self._switched.pop(task.id, None)
        return {"switch": switched} if switched else {}


def simulate_plan(plan: Plan, costs: TaskCoster, cluster: Cluster) -> SimulatedExecutor:
    """Execute every task of ``plan``; the executor holds the timeline and the end time."""
    sim = SimulatedExecutor(plan, costs, cluster)
    sim.run_until(None)
    return sim


# ---------------------------------------------------------------------------- strategies


@dataclass
class SimResult:
    spec: StrategySpec
    cluster: Cluster
    timeline: Timeline
    plan: Plan
    step_end: list[float]  # end of each step's optimizer step
    warmup_steps: int
    bound_images_per_s: float
    step_metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def images_per_step(self) -> int:
        return self.spec.groups_per_step * self.spec.group_size

    @property
    def window(self) -> tuple[float, float]:
        t0 = self.step_end[self.warmup_steps - 1] if self.warmup_steps > 0 else 0.0
        return t0, self.step_end[-1]

    @property
    def measured_steps(self) -> int:
        return len(self.step_end) - self.warmup_steps

    @property
    def step_time_s(self) -> float:
        t0, t1 = self.window
        return (t1 - t0) / self.measured_steps

    @property
    def images_per_s(self) -> float:
        return self.images_per_step / self.step_time_s

    @property
    def images_per_device_s(self) -> float:
        return self.images_per_s / self.spec.devices

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction(*self.window)

    @property
    def fraction_of_bound(self) -> float:
        return self.images_per_s / self.bound_images_per_s if self.bound_images_per_s else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "strategy": self.spec.name,
            "devices": self.spec.devices,
            "rollout_devices": self.spec.rollout_workers if self.spec.placement == "disaggregated" else self.spec.devices,
            "trainer_devices": self.spec.trainer_workers if self.spec.placement == "disaggregated" else self.spec.devices,
            "groups_per_task": self.spec.groups_per_task,
            "train_micro_batch_groups": self.spec.train_micro_batch_groups,
            "images_per_s": self.images_per_s,
            "images_per_device_s": self.images_per_device_s,
            "step_time_s": self.step_time_s,
            "bubble_fraction": self.bubble_fraction,
            "bound_images_per_s": self.bound_images_per_s,
            "fraction_of_bound": self.fraction_of_bound,
        }

    def save_gantt(self, path: str, title: str = "") -> None:
        t0, t1 = self.window
        save_gantt(self.timeline, path, t0=t0, t1=t1, title=title or f"{self.spec.name}, {self.spec.devices} devices (simulated)")


def tag_switch_seconds(spec: StrategySpec, costs: TaskCoster, cluster: Cluster) -> float:
    """What the cost model charges a trainer for switching to generation and back (TAG)."""
    if not hasattr(costs, "switch_seconds"):
        return 0.0
    dev = costs.device(cluster.device_of(spec.trainers[0]))
    group = costs.train_group(cluster)
    return costs.switch_seconds("generate", dev, group) + costs.switch_seconds("train", dev, group)


def simulate(
    spec: StrategySpec,
    costs: TaskCoster,
    cluster: Cluster,
    *,
    steps: int = 6,
    warmup: int = 2,
    mirror_loop: bool = False,
    tag_switch_s: float | None = None,
    tsp_balance: bool = False,
    gat_micro_batches: int | None = None,
    tag_groups: int | None = None,
) -> SimResult:
    """Run ``steps`` training steps of ``spec`` with the training loop's own step driver.

    Each step's elastic shares are decided from the rates measured on the steps before, it is
    planned and run until its optimizer step, then the next one is
    (:class:`~verl_digen.schedule.driver.StepDriver`, the same object the Ray loop drives). The
    first ``warmup`` steps are excluded from the metrics. ``mirror_loop=True`` reproduces the
    loop's edges (nothing to decide TAG with before a step is measured, no look-ahead after the
    last step); otherwise TAG is decided from the model's own costs until a step is measured,
    and every step, the last included, plans its look-ahead (a steady state).
    ``tag_switch_s``: TAG's switch cost (default: the cost model's); ``tsp_balance``: balance
    TSP stages from the model's per-step costs and re-balance them every step, as the loop
    does with ``digen.tsp.balance``; ``gat_micro_batches``: GAT's fixed share (None: decided
    every step from the step before, as the loop does); ``tag_groups``: TAG's fixed share (likewise).
    """
    if not 0 <= warmup < steps:
        raise ValueError(f"need 0 <= warmup ({warmup}) < steps ({steps})")
    if hasattr(costs, "for_spec"):  # the strategy's transformer calls and sharding (CostModel.for_spec)
        costs = costs.for_spec(spec)
    if tsp_balance and spec.tsp_stages > 1 and hasattr(costs, "step_profile"):
        group_size = spec.group_size
        spec = balanced_spec(spec, costs.step_profile(costs.device(cluster.device_of(spec.generators[0])), group_size))
    driver = StepDriver(
        spec,
        lambda plan: SimulatedExecutor(plan, costs, cluster),
        total_steps=steps if mirror_loop else None,
        prior=None if mirror_loop else costs.step_costs(spec, cluster),
        tag_switch_s=tag_switch_seconds(spec, costs, cluster) if tag_switch_s is None else tag_switch_s,
        tsp_rebalance=tsp_balance,
        gat_micro_batches=gat_micro_batches,
        tag_groups=tag_groups,
    )
    metrics = [driver.run_step(s) for s in range(steps)]
    if mirror_loop:
        driver.finish()
    devices = [cluster.device_of(w) for w in driver.planner.plan.workers]
    return SimResult(
        spec=driver.spec,
        cluster=cluster,
        timeline=driver.timeline,
        plan=driver.planner.plan,
        step_end=[driver.step_end[s] for s in range(steps)],
        warmup_steps=warmup,
        bound_images_per_s=costs.zero_bubble_bound(devices),
        step_metrics=metrics,
    )
