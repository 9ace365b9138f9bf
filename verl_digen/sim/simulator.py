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

:func:`simulate` drives a strategy the way the training loop does (plan one step, run it to
its optimizer step, re-measure the costs from the timeline, plan the next) and reports the
loop's metrics for the steady-state steps: images/s, images/device/s, step time, bubble
fraction, per-phase device time, and the zero-bubble bound next to them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Protocol

from verl_digen.schedule.plan import Plan, Task, TaskKind, WorkerId
from verl_digen.schedule.runner import PlanRunner
from verl_digen.schedule.strategies import StepCosts, StepPlanner, StrategySpec, measure_costs
from verl_digen.schedule.timeline import Timeline, save_gantt
from verl_digen.sim.cost_model import Cluster


class TaskCoster(Protocol):
    """What the simulator and the emulated workers need from a cost model."""

    def task_seconds(
        self, task: Task, worker: WorkerId, cluster: Cluster, *, switch_from: str | None = None
    ) -> float: ...

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
        self._events: list[tuple[float, int, str]] = []
        self._switched: dict[str, list[str]] = {}
        self._pending: list[Task] = []  # launched this instant, durations not fixed yet

    def now(self) -> float:
        return self._t

    def _launch(self, task: Task) -> None:
        # Fixed in _wait_one, once every task of this instant is launched: contention between
        # devices of one machine must see all of them.
        self._pending.append(task)

    def _start(self, task: Task) -> None:
        contention = getattr(self.costs, "contention_factor", None)
        duration = 0.0
        for w in task.workers:
            before = self.mode[w]
            d = self.costs.task_seconds(task, w, self.cluster, switch_from=before)
            if contention is not None:
                d *= contention(w, self.cluster, len(self._busy) - len(task.workers))
            duration = max(duration, d)
            after = self.costs.mode_of(task, w)
            if after is not None and after != before:
                self.mode[w] = after
                self._switched.setdefault(task.id, []).append(str(w))
        self._seq += 1
        heapq.heappush(self._events, (self._t + duration, self._seq, task.id))

    def _wait_one(self) -> tuple[str, Any]:
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

    def phase_device_seconds(self) -> dict[str, float]:
        """Busy device-seconds per task kind and step, over the measured steps."""
        t0, t1 = self.window
        out: dict[str, float] = {}
        for r in self.timeline.records:
            lo, hi = max(r.start, t0), min(r.end, t1)
            if hi > lo:
                out[r.kind] = out.get(r.kind, 0.0) + (hi - lo) * len(r.workers) / self.measured_steps
        return out

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


def tag_share(spec: StrategySpec, timeline: Any, s: int, costs: TaskCoster, cluster: Cluster) -> int:
    """TAG: how many of step ``s``'s groups the trainers generate, decided from the rates of
    step ``s - 1`` exactly as the training loop decides it (``verl_digen.schedule.elastic``)."""
    if not getattr(spec, "tag", False) or s == 0:
        return 0
    from verl_digen.schedule.elastic import decide_tag_share, tag_inputs_from_timeline

    switch_s = 0.0
    if hasattr(costs, "switch_seconds"):
        dev = costs.device(cluster.device_of(spec.trainers[0]))
        group = costs.train_group(cluster)
        switch_s = costs.switch_seconds("generate", dev, group) + costs.switch_seconds("train", dev, group)
    inputs = tag_inputs_from_timeline(spec, timeline, s - 1, switch_s)
    return decide_tag_share(inputs).groups if inputs is not None else 0


def simulate(
    spec: StrategySpec,
    costs: TaskCoster,
    cluster: Cluster,
    *,
    steps: int = 6,
    warmup: int = 2,
    mirror_loop: bool = False,
) -> SimResult:
    """Run ``steps`` training steps of ``spec`` the way the training loop does.

    Each step is planned with the costs measured on the previous step's timeline
    (``measure_costs``, as in ``verl_digen.trainer.loop``), run until its optimizer step,
    then the next one is planned. The first ``warmup`` steps are excluded from the metrics.
    ``mirror_loop=True`` reproduces the loop exactly (default :class:`StepCosts` for step 0,
    no look-ahead after the last step); otherwise step 0 is planned with the model's own
    costs and every step, the last included, plans its look-ahead (a steady state).
    """
    if not 0 <= warmup < steps:
        raise ValueError(f"need 0 <= warmup ({warmup}) < steps ({steps})")
    planner = StepPlanner(spec)
    sim = SimulatedExecutor(planner.plan, costs, cluster)
    step_costs = StepCosts() if mirror_loop else costs.step_costs(spec, cluster)
    step_end: list[float] = []
    metrics: list[dict[str, Any]] = []
    t_prev = 0.0
    images = spec.groups_per_step * spec.group_size
    for s in range(steps):
        has_next = s + 1 < steps if mirror_loop else True
        tag_groups = tag_share(spec, sim.timeline, s, costs, cluster)
        if tag_groups:
            planner.plan_step(s, step_costs, has_next=has_next, tag_groups=tag_groups)
        else:
            planner.plan_step(s, step_costs, has_next=has_next)
        sim.run_until([f"opt:{s}"])
        t_end = sim.now()
        step_end.append(t_end)
        syncs = [r for r in sim.timeline.since(t_prev) if r.kind == TaskKind.SYNC.value and r.end <= t_end]
        metrics.append(
            {
                "step": s + 1,
                "images_per_s": images / (t_end - t_prev) if t_end > t_prev else 0.0,
                "images_per_device_s": images / (t_end - t_prev) / spec.devices if t_end > t_prev else 0.0,
                "step_time_s": t_end - t_prev,
                "bubble_fraction": sim.timeline.bubble_fraction(t_prev, t_end),
                "weight_sync_s": sum(r.end - r.start for r in syncs),
            }
        )
        step_costs = measure_costs(sim.timeline.of_step(s), s, spec, step_costs)
        t_prev = t_end
    if mirror_loop:
        sim.run_until(None)
    devices = [cluster.device_of(w) for w in planner.plan.workers]
    return SimResult(
        spec=spec,
        cluster=cluster,
        timeline=sim.timeline,
        plan=planner.plan,
        step_end=step_end,
        warmup_steps=warmup,
        bound_images_per_s=costs.zero_bubble_bound(devices),
        step_metrics=metrics,
    )
