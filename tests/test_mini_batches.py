"""PPO mini-batches (veRL's ``ppo_mini_batch_size < train_batch_size``): several optimizer
steps per rollout batch. Versions count rollout batches (docs/decisions.md): only a step's
last mini-batch makes the next version, so TCSS staleness stays within one rollout batch."""

from __future__ import annotations

import dataclasses

import pytest

from verl_digen.schedule.plan import Plan, PlanError, Task, TaskId, TaskKind
from verl_digen.schedule.strategies import StepPlanner, StrategySpec


def _plan(spec: StrategySpec, steps: int = 3) -> Plan:
    planner = StepPlanner(spec)
    for s in range(steps):
        planner.plan_step(s, has_next=s + 1 < steps)
    planner.plan.check(complete_steps=range(steps))
    return planner.plan


TCSS_GAP = StrategySpec("disaggregated", rollout_workers=2, trainer_workers=2, groups_per_step=4, group_size=2,
                        gap=True, max_staleness=1, mini_batches=2)


def test_two_mini_batches_give_two_optimizer_steps_and_one_version_per_step():
    plan = _plan(TCSS_GAP)
    for s in range(3):
        opts = plan.of_kind(TaskKind.OPTIMIZER_STEP, s)
        assert [str(o.id) for o in opts] == [f"opt:{s}:m0", f"opt:{s}"]
        assert [o.version for o in opts] == [s, s + 1]  # only the last makes a version
    assert [t.version for t in plan.of_kind(TaskKind.SYNC)] == [1, 2, 3]  # one sync per rollout batch


def test_with_gap_a_mini_batch_steps_when_its_own_groups_are_in():
    plan = _plan(TCSS_GAP, steps=1)
    first = plan[TaskId.optimizer_step(0, 0)]
    trains = {t.id: t for t in plan.of_kind(TaskKind.TRAIN, 0)}
    # mini-batch 0 = the first two groups rewarded; its step waits for no reward of the other two
    assert sorted(g for d in first.deps for g in trains[d].groups) == [0, 1]
    rewards_waited = {d for d in first.deps for d in trains[d].deps}
    assert rewards_waited == {TaskId.reward((0,)), TaskId.reward((1,))}
    # mini-batch 1 trains on the weights mini-batch 0's step made
    assert all(first.id in t.deps for t in trains.values() if t.mini_batch == 1)


def test_tcss_staleness_counts_rollout_batches_never_more_than_one_behind():
    plan = _plan(TCSS_GAP, steps=4)
    gens = plan.of_kind(TaskKind.GENERATE)
    assert {t.step - t.version for t in gens} == {0, 1}  # the one-step-off pipeline, not k steps off
    for s in range(1, 4):  # step s's groups were generated ahead on version s - 1, while step s - 1 trained
        assert {t.version for t in gens if t.step == s} == {s - 1}


def test_plan_check_refuses_generating_between_mini_batches():
    spec = StrategySpec("colocated", rollout_workers=1, trainer_workers=1, groups_per_step=2, group_size=2,
                        mini_batches=2)
    plan = _plan(spec, steps=1)
    fused = spec.trainers[0]
    bad = Plan(workers=plan.workers, max_staleness=0)
    for t in plan.tasks:
        bad.add(t)
        if t.id == TaskId.optimizer_step(0, 0):  # a generate slipped between the two mini-batches
            bad.add(Task(id=TaskId.generate((99,)), kind=TaskKind.GENERATE, workers=(fused,), step=1, groups=(99,),
                         version=0))
    with pytest.raises(PlanError, match="between two mini-batches"):
        bad._check_versions()


def test_plan_check_refuses_a_mini_batch_that_does_not_wait_for_the_previous_step():
    plan = _plan(dataclasses.replace(TCSS_GAP, max_staleness=0), steps=1)
    bad = Plan(workers=plan.workers)
    for t in plan.tasks:
        if t.kind == TaskKind.TRAIN and t.mini_batch == 1:
            t = dataclasses.replace(t, deps=tuple(d for d in t.deps if d.kind != TaskKind.OPTIMIZER_STEP))
        bad.add(t)
    with pytest.raises(PlanError, match="does not wait for opt:0:m0"):
        bad.check()


@pytest.mark.parametrize("kwargs, field", [
    ({"groups_per_step": 4, "mini_batches": 3}, "mini_batches"),
    ({"groups_per_step": 4, "mini_batches": 2, "train_micro_batch_groups": 4}, "train_micro_batch_groups"),
])
def test_mini_batches_must_split_the_step_into_whole_micro_batches(kwargs, field):
    with pytest.raises(ValueError, match=f"{field}="):
        StrategySpec("disaggregated", rollout_workers=1, trainer_workers=1, group_size=2, **kwargs)
