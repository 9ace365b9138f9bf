"""Plans are data: each strategy's plan satisfies its dependencies, exclusivity and version rules."""

from __future__ import annotations

import itertools

import pytest

from verl_digen.schedule.plan import Plan, PlanError, Task, TaskId, TaskKind, WorkerId
from verl_digen.schedule.runner import PlanRunner
from verl_digen.schedule.strategies import StepPlanner, StrategySpec
from timelines import assert_exclusive


class UnitTimeRunner(PlanRunner):
    """Executes a plan in virtual time with a fixed duration per task kind.

    A minimal clock for checking plan semantics (the cost-model simulator lives in
    verl_digen.sim); it needs no Ray, which is the point: plans are data.
    """

    DURATION = {"generate": 3.0, "reward": 0.5, "train": 2.0, "optimizer_step": 0.3, "sync": 0.2}

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self._t = 0.0
        self._events: list[tuple[float, str]] = []

    def now(self) -> float:
        return self._t

    def _launch(self, task: Task) -> None:
        self._events.append((self._t + self.DURATION[task.kind.value], task.id))
        self._events.sort()

    def _wait_one(self):
        t, tid = self._events.pop(0)
        self._t = t
        return tid, None


SPECS = [
    StrategySpec("colocated", rollout_workers=2, trainer_workers=2, groups_per_step=4, group_size=2),
    StrategySpec("colocated", rollout_workers=2, trainer_workers=2, groups_per_step=4, group_size=2, gap=True),
    StrategySpec("disaggregated", rollout_workers=1, trainer_workers=1, groups_per_step=4, group_size=2),
    StrategySpec("disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=4, group_size=2, gap=True),
    StrategySpec(
        "disaggregated", rollout_workers=2, trainer_workers=2, reward_workers=1, groups_per_step=8, group_size=2,
        groups_per_task=2, train_micro_batch_groups=2, gap=True,
    ),
    StrategySpec(
        "disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=4, group_size=2, gap=True, max_staleness=1
    ),
    StrategySpec(
        "disaggregated", rollout_workers=3, trainer_workers=2, reward_workers=1, groups_per_step=6, group_size=2,
        gap=True, max_staleness=1,
    ),
]


def _planned(spec: StrategySpec, steps: int = 4) -> StepPlanner:
    planner = StepPlanner(spec)
    for s in range(steps):
        planner.plan_step(s, has_next=s + 1 < steps)
    return planner


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-r{s.rollout_workers}t{s.trainer_workers}")
def test_every_strategy_plan_passes_its_checks(spec):
    _planned(spec).plan.check(complete_steps=range(4))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-r{s.rollout_workers}t{s.trainer_workers}")
def test_execution_respects_dependencies_and_worker_exclusivity(spec):
    planner = _planned(spec)
    runner = UnitTimeRunner(planner.plan)
    runner.run_until(None)
    assert_exclusive(runner.timeline)
    end = {r.task: r.end for r in runner.timeline.records}
    start = {r.task: r.start for r in runner.timeline.records}
    for t in planner.plan.tasks:
        for d in t.deps:
            assert start[str(t.id)] >= end[str(d)], f"{t.id} started before {d} ended"
    assert len(runner.timeline.records) == len(planner.plan.tasks)


def test_sync_plan_trains_only_after_the_whole_batch_is_rewarded():
    planner = _planned(SPECS[2], steps=1)
    rewards = {t.id for t in planner.plan.of_kind(TaskKind.REWARD, 0)}
    for t in planner.plan.of_kind(TaskKind.TRAIN, 0):
        assert set(t.deps) == rewards


def test_gap_plan_trains_each_micro_batch_after_only_its_own_groups():
    planner = _planned(SPECS[3], steps=1)
    for t in planner.plan.of_kind(TaskKind.TRAIN, 0):
        assert t.deps == (TaskId.reward((t.groups[0],)),) and str(t.deps[0]) == f"reward:{t.groups[0]}"


def test_gap_starts_training_before_generation_ends():
    sync_run = UnitTimeRunner(_planned(SPECS[2], steps=1).plan)
    sync_run.run_until(None)
    gap_spec = StrategySpec("disaggregated", rollout_workers=1, trainer_workers=1, groups_per_step=4, group_size=2, gap=True)
    gap_run = UnitTimeRunner(_planned(gap_spec, steps=1).plan)
    gap_run.run_until(None)

    def first_train(run):
        return min(r.start for r in run.timeline.records if r.kind == "train")

    def last_gen(run):
        return max(r.end for r in run.timeline.records if r.kind == "generate")

    assert first_train(gap_run) < last_gen(gap_run)
    assert first_train(sync_run) >= last_gen(sync_run)
    assert gap_run.now() < sync_run.now()


def test_on_policy_plan_never_generates_with_old_weights():
    for spec in SPECS[:5]:
        for t in _planned(spec).plan.of_kind(TaskKind.GENERATE):
            assert t.version == t.step


def test_tcss_plan_overlaps_next_step_generation_with_the_drain():
    spec = SPECS[5]
    planner = _planned(spec)
    stale = [t for t in planner.plan.of_kind(TaskKind.GENERATE) if t.version == t.step - 1]
    assert stale, "TCSS should generate some groups on the previous weights"
    assert all(t.step - t.version <= 1 for t in planner.plan.of_kind(TaskKind.GENERATE))
    run = UnitTimeRunner(planner.plan)
    run.run_until(None)
    rec = {r.task: r for r in run.timeline.records}
    # Some stale generation runs while the trainer is still training the previous step.
    assert any(rec[str(t.id)].start < rec[f"opt:{t.step - 1}"].end for t in stale)


def test_tcss_makes_the_same_work_faster_than_on_policy():
    on = StrategySpec("disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=4, group_size=2, gap=True)
    tc = StrategySpec("disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=4, group_size=2, gap=True,
                      max_staleness=1)
    times = []
    for spec in (on, tc):
        run = UnitTimeRunner(_planned(spec, steps=5).plan)
        run.run_until(None)
        times.append(run.now())
    assert times[1] < times[0]


def test_plan_check_rejects_a_generate_task_that_lies_about_its_version():
    planner = _planned(SPECS[2], steps=2)
    plan = planner.plan
    bad = next(t for t in plan.tasks if t.kind == TaskKind.GENERATE and t.step == 1)
    i = plan.tasks.index(bad)
    plan.tasks[i] = Task(bad.id, bad.kind, bad.workers, bad.step, bad.deps, bad.groups, version=0, images=bad.images)
    with pytest.raises(PlanError, match="version"):
        plan.check()


def test_plan_check_rejects_a_group_trained_twice():
    planner = _planned(SPECS[2], steps=1)
    plan = planner.plan
    t = plan.of_kind(TaskKind.TRAIN, 0)[0]
    with pytest.raises(PlanError, match="more than one train"):
        plan.add(Task(TaskId.train(0, 99), TaskKind.TRAIN, t.workers, 0, t.deps, t.groups))
        plan.check()


def test_plan_check_rejects_staleness_above_the_bound():
    w = [WorkerId("rollout", 0), WorkerId("trainer", 0)]
    plan = Plan(workers=w, max_staleness=0)
    plan.add(Task(TaskId.generate((0,)), TaskKind.GENERATE, (w[0],), step=1, groups=(0,), version=0))
    with pytest.raises(PlanError, match="staleness 1"):
        plan.check(complete_steps=[])


def test_plan_rejects_dependency_on_a_later_task():
    plan = Plan(workers=[WorkerId("fused", 0)])
    with pytest.raises(PlanError, match="not earlier"):
        plan.add(Task(TaskId.reward((0,)), TaskKind.REWARD, (WorkerId("fused", 0),), 0, deps=(TaskId.generate((0,)),)))


def test_every_group_is_generated_rewarded_and_trained_exactly_once():
    for spec in SPECS:
        plan = _planned(spec).plan
        for kind in (TaskKind.GENERATE, TaskKind.REWARD, TaskKind.TRAIN):
            groups = sorted(itertools.chain.from_iterable(t.groups for t in plan.of_kind(kind)))
            assert groups == list(range(4 * spec.groups_per_step)), (spec.name, kind)


TSP_SPECS = [
    StrategySpec("disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=4, group_size=2, gap=True,
                 tsp_stages=2, num_steps=6),
    StrategySpec("disaggregated", rollout_workers=6, trainer_workers=2, groups_per_step=6, group_size=2, gap=True,
                 tsp_stages=3, num_steps=9, stage_bounds=(0, 2, 6, 9), max_staleness=1),
]


@pytest.mark.parametrize("spec", TSP_SPECS, ids=lambda s: s.name)
def test_tsp_plans_chain_stages_over_the_denoising_steps(spec):
    planner = _planned(spec)
    planner.plan.check(complete_steps=range(4))
    gens = [t for t in planner.plan.of_kind(TaskKind.GENERATE) if 0 in t.groups]
    assert [t.denoise for t in gens] == list(zip(spec.bounds, spec.bounds[1:]))
    assert [t.worker.rank for t in gens] == list(range(spec.tsp_stages))
    run = UnitTimeRunner(planner.plan)
    run.run_until(None)
    assert_exclusive(run.timeline)


def test_tsp_plan_check_rejects_a_trajectory_that_changes_version_between_stages():
    planner = _planned(TSP_SPECS[0], steps=1)
    plan = planner.plan
    t = next(t for t in plan.tasks if t.kind == TaskKind.GENERATE and t.denoise and t.denoise[0] > 0)
    i = plan.tasks.index(t)
    from dataclasses import replace

    plan.tasks[i] = replace(t, version=1)
    with pytest.raises(PlanError, match="versions|version"):
        plan.check()


def test_tsp_finished_groups_leave_at_a_steady_cadence_instead_of_in_bursts():
    """K data-parallel workers finish K groups at once; a K-stage pipeline releases them one by one."""
    dp = StrategySpec("disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=4, group_size=2, gap=True)
    tsp = StrategySpec("disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=4, group_size=2, gap=True,
                       tsp_stages=2, num_steps=8)

    def finish_times(spec):
        run = UnitTimeRunner(_planned(spec, steps=1).plan)
        run.run_until(None)
        return sorted(r.end for r in run.timeline.records if r.kind == "generate" and (r.task.endswith("s1") or ":s" not in r.task))

    dp_t, tsp_t = finish_times(dp), finish_times(tsp)
    assert len(set(dp_t)) < len(dp_t)  # bursts: two groups finish at the same instant
    assert len(set(tsp_t)) == len(tsp_t)  # pipeline: one at a time


def test_timestep_split_puts_every_micro_batch_on_every_trainer_rank():
    spec = StrategySpec("disaggregated", rollout_workers=1, trainer_workers=2, groups_per_step=3, group_size=2, gap=True,
                        train_split="timestep")
    planner = _planned(spec, steps=2)
    planner.plan.check(complete_steps=range(2))
    trains = planner.plan.of_kind(TaskKind.TRAIN, 0)
    assert len(trains) == 6 and {t.train_part for t in trains} == {(0, 2), (1, 2)}


def test_tag_groups_run_on_trainers_with_the_newest_weights():
    spec = StrategySpec("disaggregated", rollout_workers=1, trainer_workers=2, groups_per_step=4, group_size=2, gap=True,
                        tag=True)
    planner = StepPlanner(spec)
    for s in range(3):
        planner.plan_step(s, tag_groups=2 if s else 0, has_next=s < 2)
    planner.plan.check(complete_steps=range(3))
    tag_tasks = [t for t in planner.plan.of_kind(TaskKind.GENERATE) if t.worker.pool == "trainer"]
    assert len(tag_tasks) == 4 and all(t.version == t.step for t in tag_tasks)
    run = UnitTimeRunner(planner.plan)
    run.run_until(None)
    assert_exclusive(run.timeline)
    groups = sorted(g for t in planner.plan.of_kind(TaskKind.TRAIN) for g in t.groups)
    assert groups == list(range(12))  # every group, TAG or not, trained exactly once


def test_edge_idle_counts_waiting_not_other_work():
    from verl_digen.schedule.timeline import TaskRecord, Timeline

    tl = Timeline(workers=["trainer0", "rollout0"])
    tl.add(TaskRecord("sync:1", "sync", ["trainer0", "rollout0"], 0.0, 1.0, 0, 1))
    tl.add(TaskRecord("gen:0", "generate", ["rollout0"], 1.0, 5.0, 0, 1, [0]))
    tl.add(TaskRecord("train:0:0", "train", ["trainer0"], 5.0, 9.0, 0, 0, [0]))
    tl.add(TaskRecord("opt:0", "optimizer_step", ["trainer0"], 9.0, 10.0, 0, 1))
    head, _ = tl.edge_idle(["trainer0"], 0.0, 10.0, head_kind="train")
    _, drain = tl.edge_idle(["rollout0"], 0.0, 10.0, drain_kind="generate")
    assert head == pytest.approx(0.4)  # waited 1..5 for the first group; the sync was work
    assert drain == pytest.approx(0.5)  # idle 5..10 while the trainer drained


def test_ids_sent_to_another_process_find_the_ids_built_there():
    """A task id caches its hash (the runner looks ids up millions of times in a planner search),
    and a string's hash differs between processes: an id unpickled in another process (a Ray
    worker, an emulated device) must hash as an id built there, and worker ids alike."""
    import os
    import pickle
    import subprocess
    import sys

    ids = [TaskId.generate((3, 4), sample_slice=1, stage=0), TaskId.reward((3, 4)), TaskId.train(2, 1, part=0),
           TaskId.optimizer_step(2, 0), TaskId.sync(3), WorkerId("trainer", 1)]
    code = (
        "import pickle, sys\n"
        "from verl_digen.schedule.plan import TaskId, WorkerId\n"
        "sent = pickle.loads(sys.stdin.buffer.read())\n"
        "here = [TaskId.generate((3, 4), sample_slice=1, stage=0), TaskId.reward((3, 4)), TaskId.train(2, 1, part=0),\n"
        "        TaskId.optimizer_step(2, 0), TaskId.sync(3), WorkerId('trainer', 1)]\n"
        "assert sent['ids'] == here, (sent['ids'], here)\n"
        "assert [sent['by_id'][i] for i in here] == list(range(len(here)))\n"
        "assert all(hash(a) == hash(b) for a, b in zip(sent['ids'], here))\n"
        "print([str(i) for i in sent['ids']])\n"
    )
    payload = pickle.dumps({"ids": ids, "by_id": {i: n for n, i in enumerate(ids)}})
    # another hash seed than this process's: strings (and the enum of a task's kind) hash differently there
    env = dict(os.environ, PYTHONHASHSEED=str(1 + int(os.environ.get("PYTHONHASHSEED", "0") or 0)))
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == str([str(i) for i in ids])
