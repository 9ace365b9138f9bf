"""Pulled work units (``digen.units``): tasks taken by whichever worker of their pool is free
next, training micro-batches in row slices, a fixed sample split.

The runner's rules are checked on plans run in virtual time (plans are data); a real Ray run
checks that pulling changes where work runs, not what it computes (tests/e2e/test_pull_e2e.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.schedule.elastic import seconds_per_group
from verl_digen.schedule.plan import Plan, PlanError, Task, TaskId, TaskKind, WorkerId
from verl_digen.schedule.strategies import StepPlanner, StrategySpec
from verl_digen.sim.cost_model import TableCostModel
from verl_digen.sim.simulator import SimulatedExecutor
from timelines import assert_exclusive

SECONDS = {"generate": 1.0, "reward": 0.1, "train": 0.5, "optimizer_step": 0.1, "sync": 0.1}


class UnevenCosts(TableCostModel):
    """The table's seconds, times a factor per worker and a seeded jitter per task.

    Why not a calibrated profile: these tests need tasks whose durations differ by worker and
    by task in ways a test controls exactly (a slow device, random durations), which is what
    pulling is for; the cost model's profiles are deterministic per device type."""

    def __init__(self, slow: dict[str, float] | None = None, jitter: float = 0.0, seed: int = 0) -> None:
        super().__init__(seconds=SECONDS)
        self.slow = slow or {}
        self.jitter = jitter
        self.rng = random.Random(seed)

    def task_seconds(self, task, worker, cluster=None, *, switch_from=None):
        t = super().task_seconds(task, worker, cluster, switch_from=switch_from)
        return t * self.slow.get(str(worker), 1.0) * (1.0 + self.jitter * self.rng.random())


def plan_of(spec: StrategySpec, steps: int = 3, *, gat: int = 0) -> Plan:
    planner = StepPlanner(spec)
    for s in range(steps):
        planner.plan_step(s, has_next=s < steps - 1, gat_micro_batches=gat)
    planner.plan.check()
    return planner.plan


def run_plan(plan: Plan, costs) -> SimulatedExecutor:
    sim = SimulatedExecutor(plan, costs, None)
    sim.run_until()
    return sim


def tasks_by_text(plan: Plan) -> dict[str, Task]:
    """The plan's tasks by their id's text form, which timeline records carry."""
    return {str(t.id): t for t in plan.tasks}


def assert_versions_held(plan: Plan, sim: SimulatedExecutor) -> None:
    """Replay every worker's weights version along the timeline (a sync or the last mini-batch's
    optimizer step sets it at its end): every generate task found the version it declares on the
    worker that ran it, and a rollout worker's training (GAT) found the step's."""
    events = []
    by_text = tasks_by_text(plan)
    for r in sim.timeline.records:
        task = by_text[r.task]
        events.append((r.start, 1, task, r.workers))
        if task.kind == TaskKind.SYNC or (task.kind == TaskKind.OPTIMIZER_STEP and task.id.mini_batch is None):
            events.append((r.end, 0, task, r.workers))
    held = {str(w): plan.start_version for w in plan.workers}
    for _, starting, task, workers in sorted(events, key=lambda e: (e[0], e[1])):
        if not starting:
            for w in workers:
                held[w] = task.version
        elif task.kind == TaskKind.GENERATE:
            assert held[workers[0]] == task.version, f"{task.id} ran on {workers[0]} holding {held[workers[0]]}"
        elif task.kind == TaskKind.TRAIN and workers[0].startswith("rollout"):
            assert held[workers[0]] == task.step, f"{task.id} (GAT) ran on {workers[0]} holding {held[workers[0]]}"


def assert_ran_once(plan: Plan, sim: SimulatedExecutor) -> None:
    ran = [r.task for r in sim.timeline.records]
    assert sorted(ran) == sorted(str(t.id) for t in plan.tasks)
    by_text = tasks_by_text(plan)
    for r in sim.timeline.records:
        task = by_text[r.task]
        if task.pulled:
            assert len(r.workers) == 1 and r.workers[0] in {str(w) for w in task.workers}
        else:
            assert r.workers == [str(w) for w in task.workers]
    assert_exclusive(sim.timeline)


# ----------------------------------------------------------------------------- the plan


def test_pulled_tasks_name_their_candidates_and_have_no_worker_before_they_run():
    spec = StrategySpec("disaggregated", 3, 2, 6, 4, gap=True, pull=True, train_slices=2, reward_workers=2)
    plan = plan_of(spec, steps=1)
    gens = plan.of_kind(TaskKind.GENERATE)
    rollouts = tuple(WorkerId("rollout", r) for r in range(3))
    assert all(t.pull and t.workers == rollouts for t in gens)
    assert all(t.pull and t.workers == (WorkerId("reward", 0), WorkerId("reward", 1))
               for t in plan.of_kind(TaskKind.REWARD))
    trains = plan.of_kind(TaskKind.TRAIN)
    assert [str(t.id) for t in trains[:2]] == ["train:0:0:r0", "train:0:0:r1"]
    assert all(t.row_part in ((0, 2), (1, 2)) and t.images == 2 and t.pull for t in trains)
    with pytest.raises(PlanError, match="has no worker before it runs"):
        gens[0].worker
    # round-robin (the default) is unchanged: one worker per task
    plain = plan_of(dataclasses.replace(spec, pull=False, train_slices=1), steps=1)
    assert all(not t.pull and len(t.workers) == 1 for t in plain.of_kind(TaskKind.GENERATE))


def test_the_plan_check_refuses_row_slices_that_do_not_tile_a_micro_batch():
    spec = StrategySpec("disaggregated", 2, 2, 4, 4, gap=True, pull=True, train_slices=2)
    plan = plan_of(spec, steps=1)
    plan.check()
    tasks = list(plan.tasks)
    i = next(k for k, t in enumerate(tasks) if str(t.id) == "train:0:1:r1")
    mutated = tasks[:i] + [dataclasses.replace(tasks[i], row_part=(1, 3))] + tasks[i + 1:]
    with pytest.raises(PlanError, match="row slices .* do not tile it"):
        Plan(workers=plan.workers, tasks=mutated).check()
    dropped = [t for t in tasks if str(t.id) != "train:0:1:r1"]
    dropped = [dataclasses.replace(t, deps=tuple(d for d in t.deps if str(d) != "train:0:1:r1")) for t in dropped]
    with pytest.raises(PlanError, match="row slices .* do not tile it"):
        Plan(workers=plan.workers, tasks=dropped).check()


def test_a_pulled_generate_task_must_find_its_version_on_every_candidate():
    """A pulled task may run on any candidate, so the version check asks all of them: a generate
    task of version 1 pulled by a pool where one worker never received version 1 is refused."""
    spec = StrategySpec("disaggregated", 2, 1, 2, 2, pull=True)
    plan = plan_of(spec, steps=2)
    tasks = list(plan.tasks)
    i = next(k for k, t in enumerate(tasks) if t.kind == TaskKind.SYNC and t.version == 1)
    narrowed = dataclasses.replace(tasks[i], workers=(WorkerId("rollout", 0),))
    with pytest.raises(PlanError, match="declares weights version 1 but rollout1 holds 0"):
        Plan(workers=plan.workers, tasks=tasks[:i] + [narrowed] + tasks[i + 1:]).check()


# ----------------------------------------------------------------------------- the runner


def test_a_slow_worker_takes_fewer_pulled_units_and_the_step_ends_sooner():
    """One rollout device three times slower than the others: round-robin deals it a third of the
    groups and every step waits for it; pulled, it takes what it can and the others take the rest."""
    spec = StrategySpec("disaggregated", 3, 2, 12, 2, gap=True, max_staleness=1)
    slow = {"rollout0": 3.0}
    rr = run_plan(plan_of(spec), UnevenCosts(slow))
    pulled_plan = plan_of(dataclasses.replace(spec, pull=True))
    pulled = run_plan(pulled_plan, UnevenCosts(slow))
    assert_ran_once(pulled_plan, pulled)
    assert_versions_held(pulled_plan, pulled)

    def gens_on(sim, w):
        return sum(1 for r in sim.timeline.records if r.kind == "generate" and r.workers == [w])

    assert gens_on(rr, "rollout0") == gens_on(rr, "rollout1") == 12
    assert gens_on(pulled, "rollout0") < gens_on(pulled, "rollout1")
    assert pulled.now() < rr.now()


def test_on_equal_workers_pulling_changes_nothing():
    """Equal devices, equal tasks: the first free worker is the one round-robin picks, so the
    timeline is the same, task for task."""
    spec = StrategySpec("disaggregated", 2, 2, 4, 2, gap=True, max_staleness=1, reward_workers=2)
    rr = run_plan(plan_of(spec), UnevenCosts())
    pulled = run_plan(plan_of(dataclasses.replace(spec, pull=True)), UnevenCosts())
    assert [(r.task, r.workers, r.start, r.end) for r in pulled.timeline.records] == \
        [(r.task, r.workers, r.start, r.end) for r in rr.timeline.records]


def test_a_weight_sync_waits_until_every_task_planned_before_it_started():
    """One-step-off: the rollout pool pulls step k+1's groups (version k) before the sync of
    version k+1, and step k+2's after it. A fast worker must not run into the sync while a slow
    one still has an unstarted earlier unit, and no unit of version k+1 starts before the sync."""
    spec = StrategySpec("disaggregated", 3, 1, 6, 2, gap=True, max_staleness=1, pull=True)
    plan = plan_of(spec, steps=4)
    sim = run_plan(plan, UnevenCosts({"rollout2": 4.0}, jitter=0.5, seed=3))
    assert_ran_once(plan, sim)
    assert_versions_held(plan, sim)
    start = {r.task: r.start for r in sim.timeline.records}
    end = {r.task: r.end for r in sim.timeline.records}
    for sync in plan.of_kind(TaskKind.SYNC):
        for t in plan.of_kind(TaskKind.GENERATE):
            if t.version < sync.version:
                assert start[str(t.id)] <= start[str(sync.id)]
            else:
                assert start[str(t.id)] >= end[str(sync.id)]


def test_a_gang_waits_for_a_pulled_task_planned_before_it_that_is_not_ready_yet():
    """A pulled task P of rollout0/1 waits for X on the trainer; the gang G of rollout0/1 comes
    after P in the plan. Both rollout workers are idle at once, but G must not start before P
    has (a sync there would hand P's worker weights of the wrong version)."""
    r0, r1, t0 = WorkerId("rollout", 0), WorkerId("rollout", 1), WorkerId("trainer", 0)
    plan = Plan(workers=[r0, r1, t0])
    x = plan.add(Task(id=TaskId.train(0, 0), kind=TaskKind.TRAIN, workers=(t0,), step=0))
    p = plan.add(Task(id=TaskId.generate((0,)), kind=TaskKind.GENERATE, workers=(r0, r1), step=0, deps=(x.id,),
                      pull=True))
    g = plan.add(Task(id=TaskId.sync(1), kind=TaskKind.SYNC, workers=(r0, r1), step=0, version=1))
    sim = run_plan(plan, UnevenCosts())
    start = {r.task: r.start for r in sim.timeline.records}
    assert start[str(x.id)] == 0.0 and start[str(p.id)] == pytest.approx(0.5)
    assert start[str(g.id)] >= start[str(p.id)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spec", [
    StrategySpec("disaggregated", 3, 2, 6, 4, gap=True, pull=True, train_slices=2),
    StrategySpec("disaggregated", 3, 2, 6, 4, gap=True, pull=True, max_staleness=1, reward_workers=2),
    StrategySpec("disaggregated", 2, 3, 4, 4, gap=True, pull=True, train_slices=4, mini_batches=2, max_staleness=1),
    StrategySpec("disaggregated", 3, 1, 6, 4, gap=True, pull=True, gat=True, sample_slices=2),
    StrategySpec("disaggregated", 3, 2, 6, 4, gap=True, pull=True, fsdp=True, max_staleness=1),
], ids=["slices", "tcss-reward-pool", "mini-batches", "gat", "fsdp-gang"])
def test_pulled_plans_finish_under_random_durations(spec, seed):
    """Any durations: every task runs once on one of its candidates, one at a time per worker,
    every generate task on the version it declares; the plan never stalls."""
    plan = plan_of(spec, steps=3, gat=2 if spec.gat else 0)
    sim = run_plan(plan, UnevenCosts({"rollout0": 1.0 + seed}, jitter=2.0, seed=seed))
    assert_ran_once(plan, sim)
    assert_versions_held(plan, sim)
    if spec.gat:
        assert any(r.kind == "train" and r.workers[0].startswith("rollout") for r in sim.timeline.records)


def test_measured_training_rate_counts_a_row_slice_as_its_share_of_a_group():
    spec = StrategySpec("disaggregated", 2, 2, 4, 4, gap=True, pull=True, train_slices=2)
    sim = run_plan(plan_of(spec, steps=1), UnevenCosts())
    # every row slice is 0.5 s of half a group: 1 s per group, as TAG and GAT read the rates
    assert seconds_per_group(sim.timeline, "train", 0) == pytest.approx(1.0)


def test_gat_models_pulled_training_as_slices_spread_over_the_trainers():
    """GAT's step model: 3 micro-batches of their own on 2 trainers take 2 micro-batch times
    round-robin, 1.5 pulled in 2 row slices (the free trainer takes the next slice)."""
    from verl_digen.schedule.elastic import GatInputs, gat_step_time

    base = GatInputs(groups_per_step=4, train_micro_batch_groups=1, first_mini_batch=4, rollout_workers=1,
                     trainer_workers=2, rollout_generate_per_group=0.1, train_per_group=1.0,
                     rollout_train_per_group=10.0)
    pulled = dataclasses.replace(base, pulled_slices=2)
    assert gat_step_time(pulled, 0) == pytest.approx(2.0)  # 4 micro-batches, 8 slices, 4 each
    rr_own = gat_step_time(dataclasses.replace(base, rollout_train_per_group=0.01), 1)
    pulled_own = gat_step_time(dataclasses.replace(pulled, rollout_train_per_group=0.01), 1)
    assert rr_own == pytest.approx(2.0) and pulled_own == pytest.approx(1.5)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides,match", [
    (dict(units=dict(pull=True), placement="colocated"), "digen.units.pull=True; pulling work units needs digen.placement=disaggregated"),
    (dict(units=dict(pull=True), tsp=dict(stages=2), pools=dict(rollout=dict(devices=2))),
     "digen.units.pull=True; a TSP pipeline chains its stages on fixed workers"),
    (dict(units=dict(train_slices=2)), "digen.units.train_slices=2; row slices are pulled by the free trainers; set digen.units.pull=true"),
    (dict(units=dict(pull=True, train_slices=3)), "digen.units.train_slices=3; must divide a micro-batch's 4 rows"),
    (dict(units=dict(pull=True, train_slices=2), fsdp=dict(enable=True)),
     "digen.units.train_slices=2; an FSDP gang already splits"),
    (dict(units=dict(pull=True, train_slices=2), tsp=dict(train_split="timestep")),
     "digen.units.train_slices=2; slices a micro-batch by rows; needs digen.tsp.train_split=sample"),
    (dict(units=dict(sample_slices=3)), "digen.units.sample_slices=3; must be >= 1 and divide digen.batch.group_size=4"),
    (dict(units=dict(sample_slices="some")), "digen.units.sample_slices='some'; valid: auto or an integer"),
    (dict(units=dict(train_slices=0)), "digen.units.train_slices=0; valid: an integer >= 1"),
])
def test_unit_config_rules_name_their_key(overrides, match):
    d = {"placement": "disaggregated", **overrides}
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        digen_config_from_dict(d).validate()


def test_row_slices_make_every_transformer_call_a_whole_part_of_a_slice():
    """The call rows (rollout and training alike) divide a micro-batch into whole calls per row
    slice, as FSDP ranks are dealt: 2 groups of 4 in 4 slices -> calls of 2 rows."""
    cfg = digen_config_from_dict({"placement": "disaggregated", "batch": {"train_micro_batch_groups": 2},
                                  "units": {"pull": True, "train_slices": 4}})
    cfg.validate()
    assert cfg.pass_rows(2) == 2
    fields = cfg.strategy_fields()
    assert (fields["pull"], fields["train_slices"], fields["sample_slices"]) == (True, 4, None)
    fixed = digen_config_from_dict({"placement": "disaggregated", "units": {"sample_slices": 2}})
    fixed.validate()
    assert fixed.pass_rows(2) == 2 and fixed.strategy_fields()["sample_slices"] == 2
