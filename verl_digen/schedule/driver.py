"""The step driver: what one training step does, for every executor.

A step is: decide the elastic shares from what the previous step measured (TAG's share of
generation on the trainers, GAT's share of training on the rollout workers, TSP's stage
boundaries), append the step to the plan (under TCSS with TAG, deciding the next step's TAG
share for its look-ahead too), run the plan until the step's optimizer step, and read the
step's metrics off the timeline.

:class:`StepDriver` does exactly that and nothing else. The Ray training loop
(:mod:`verl_digen.trainer.loop`) wraps it with Ray, prompts, checkpoints, validation and
logging; the simulator (:mod:`verl_digen.sim.simulator`) wraps it with a virtual clock. So the
simulator's prediction is of the step the loop actually runs.
"""

from __future__ import annotations

from typing import Any, Callable

from verl_digen.schedule.elastic import gat_decision, rebalanced_spec, tag_decision
from verl_digen.schedule.metrics import step_timing_metrics
from verl_digen.schedule.plan import Plan, TaskId
from verl_digen.schedule.runner import PlanRunner
from verl_digen.schedule.strategies import StepCosts, StepPlanner, StrategySpec


class StepDriver:
    """Plans and runs one training step at a time on the executor ``make_executor`` builds.

    - ``start_step``: the first step (a resumed run continues from its checkpoint's step);
    - ``total_steps``: the step after the last one (no look-ahead is planned past it); None
      plans a look-ahead after every step (a steady state, for the simulator);
    - ``prior``: predicted per-unit costs TAG decides with while no step is measured yet (the
      steady-state simulator's model); None: TAG assigns nothing until then, as in the loop;
    - ``tag_switch_s``: what a trainer pays to switch from generating to training (TAG);
    - ``tsp_rebalance``: move TSP stage boundaries from the stage times measured each step;
    - ``gat_micro_batches``: GAT's micro-batches every step (None: decided per step);
    - ``tag_groups``: TAG's groups every step (None: decided per step).

    Under TCSS with TAG, a step's TAG share is decided when the step before is planned (from
    the step before that): the look-ahead generates the rest of the step ahead and leaves the
    share to the trainers.
    """

    def __init__(
        self,
        spec: StrategySpec,
        make_executor: Callable[[Plan], PlanRunner],
        *,
        start_step: int = 0,
        total_steps: int | None = None,
        prior: StepCosts | None = None,
        tag_switch_s: float = 0.0,
        tsp_rebalance: bool = False,
        gat_micro_batches: int | None = None,
        tag_groups: int | None = None,
    ) -> None:
        self.spec = spec
        self.planner = StepPlanner(spec, start_step=start_step)
        self.executor = make_executor(self.planner.plan)
        self.first_step = start_step
        self.total_steps = total_steps
        self.prior = prior
        self.tag_switch_s = tag_switch_s
        self.tsp_rebalance = tsp_rebalance
        self.gat_micro_batches = gat_micro_batches
        self.tag_groups = tag_groups
        self._tag_ahead: dict[int, tuple[dict[str, float], int]] = {}  # step -> its TAG decision (TCSS)
        self.stage_changes: list[dict[str, Any]] = []  # TSP boundaries moved: {"step", "bounds"}
        self.step_end: dict[int, float] = {}  # executor time at each step's optimizer step

    @property
    def timeline(self):
        return self.executor.timeline

    def run_step(self, step: int) -> dict[str, Any]:
        """Decide, plan and run ``step`` to its optimizer step; return its metrics."""
        ex = self.executor
        t0 = ex.now()
        tag_metrics, tag_groups = self._tag_ahead.pop(step, None) or self._tag(step, step - 1)
        gat_metrics, gat_mbs = gat_decision(self.spec, ex.timeline, step, self.gat_micro_batches)
        if self.tsp_rebalance and self.spec.tsp_stages > 1 and step > self.first_step:
            spec = rebalanced_spec(self.spec, ex.timeline, step - 1)
            if spec is not self.spec:
                self.stage_changes.append({"step": step, "bounds": list(spec.bounds)})
                self.spec = self.planner.spec = spec
        has_next = self.total_steps is None or step + 1 < self.total_steps
        next_tag = 0
        if has_next and self.spec.tag and self.spec.max_staleness:
            # the look-ahead planned with this step generates the next one: decide its TAG share
            # now, from the last step measured in full
            self._tag_ahead[step + 1] = self._tag(step + 1, step - 1)
            next_tag = self._tag_ahead[step + 1][1]
        self.planner.plan_step(step, has_next=has_next, tag_groups=tag_groups,
                               gat_micro_batches=gat_mbs, next_tag_groups=next_tag)
        ex.run_until([TaskId.optimizer_step(step)])
        t1 = ex.now()
        self.step_end[step] = t1
        metrics = step_timing_metrics(self.spec, ex.timeline, step, t0, t1)
        metrics.update(ex.step_metrics(step))
        metrics.update(tag_metrics)
        metrics.update(gat_metrics)
        return metrics

    def _tag(self, step: int, measured: int) -> tuple[dict[str, float], int]:
        """TAG's metrics and share of ``step`` from the rates measured in step ``measured``."""
        return tag_decision(self.spec, self.executor.timeline, step, self.tag_switch_s, self.tag_groups,
                            measured=measured, prior=self.prior)

    def finish(self) -> None:
        """Run what is still planned (the final weight sync); check the executed plan."""
        self.executor.run_until(None)
        if self.total_steps is not None:
            self.executor.plan.check(complete_steps=range(self.first_step, self.total_steps))
