"""Every mechanism combination the planner supports plans what the strategy's rules say.

The planner composes one mechanism per question (``strategies.layout_of``). Here each plan of
every valid combination (colocated / disaggregated, GAP, TCSS, TSP, the time-step split, TAG,
FSDP; several pool sizes, batch shapes and resumed starts) is

- checked against its invariants (``Plan.check``, typed ids naming their task), and
- compared, task by task in plan order (id, kind, workers, step, dependencies in order,
  groups, version, images, stage, parts), with :func:`reference_plan`: the same rules written
  flat, one loop per step, with ids in their documented text form.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from verl_digen.schedule.plan import Plan, TaskId, TaskKind, WorkerId, chunk, group_ids, sample_slices
from verl_digen.schedule.strategies import StepPlanner, StrategySpec, call_rows

MECHANISMS = list(itertools.product(("colocated", "disaggregated"), (False, True), (0, 1), (1, 2),
                                    ("sample", "timestep"), (False, True), (False, True)))
# rollout, trainer, reward workers, groups_per_step, group_size, groups_per_task, train_micro_batch_groups,
# PPO mini-batches per step
SHAPES = [(1, 1, 0, 2, 2, 1, 1, 1), (2, 1, 0, 4, 2, 1, 1, 1), (2, 2, 1, 4, 4, 2, 2, 1), (4, 2, 2, 8, 2, 1, 2, 1),
          (4, 3, 0, 4, 4, 2, 1, 1), (2, 3, 2, 2, 4, 1, 2, 1), (4, 1, 1, 12, 2, 2, 3, 1),
          (2, 2, 1, 4, 2, 1, 1, 2), (4, 2, 0, 8, 2, 2, 2, 2), (2, 1, 1, 12, 2, 1, 1, 3)]
STEPS = 4


def _specs(placement, gap, staleness, tsp, split, tag, fsdp) -> list[StrategySpec]:
    out = []
    for r, t, rw, g, gs, gpt, mb, minis in SHAPES:
        try:
            out.append(StrategySpec(
                placement=placement, rollout_workers=r, trainer_workers=t, reward_workers=rw, groups_per_step=g,
                group_size=gs, groups_per_task=gpt, train_micro_batch_groups=mb, mini_batches=minis,
                gap=gap, max_staleness=staleness,
                tsp_stages=tsp, train_split=split, tag=tag, fsdp=fsdp, num_steps=8,
                stage_bounds=(0, 3, 8) if tsp == 2 and r == 4 else None,
            ))
        except ValueError:
            pass  # not a valid combination for this shape
    return out


def _tag_shares(spec: StrategySpec) -> list[int]:
    """None, all, a share that is not a whole unit (whole tasks; FSDP: per trainer rank), none:
    every TAG branch."""
    return [0, spec.groups_per_step, spec.tag_unit + 1, 0] if spec.tag else [0] * STEPS


def _rows(tasks) -> list[tuple]:
    return [(str(t.id), t.kind.value, tuple(str(w) for w in t.workers), t.step, tuple(str(d) for d in t.deps),
             t.groups, t.version, t.images, t.denoise, t.final, t.stage, t.train_part, t.samples, t.mini_batch)
            for t in tasks]


def _planned(spec: StrategySpec, start: int) -> Plan:
    planner = StepPlanner(spec, start_step=start)
    shares = _tag_shares(spec)
    for i, (s, share) in enumerate(zip(range(start, start + STEPS), shares)):
        nxt = shares[i + 1] if i + 1 < STEPS and spec.max_staleness else 0  # as the step driver passes it
        planner.plan_step(s, has_next=i + 1 < STEPS, tag_groups=share, next_tag_groups=nxt)
    return planner.plan


# ----------------------------------------------------------------------------- the reference


def reference_plan(spec: StrategySpec, start: int) -> list[tuple]:
    """The plan's rows as the strategy's rules state them (see ``strategies`` and ``mechanisms``)."""
    rows: list[tuple] = []
    held = Counter({str(w): start for w in spec.workers()})  # weights version per worker
    turn: Counter[str] = Counter()  # round-robin positions: generators, TAG trainers, reward pool
    reward_of: dict[int, str] = {}  # group -> its reward task
    position: dict[str, int] = {}  # reward task -> how many tasks were planned up to it
    first_worker: dict[str, str] = {}  # reward task -> the worker of its first final generate task
    ahead: dict[int, list[int]] = {}
    trainers = [str(w) for w in spec.trainers]
    k_stages, bounds = spec.tsp_stages, spec.bounds

    def take(rotation: str, lanes: int) -> int:
        turn[rotation] += 1
        return (turn[rotation] - 1) % lanes

    def generate(step: int, groups: list[int], on_trainers: bool, deps: tuple[str, ...]) -> None:
        split = tag_split if on_trainers else spec.sample_split
        for tg in chunk(groups, spec.groups_per_task):
            tag = "-".join(map(str, tg))
            finals = []
            for part, samples in enumerate(sample_slices(spec.group_size, split)):
                if on_trainers:
                    chain = [(trainers[take("tag", len(trainers))], None)]
                elif k_stages > 1:
                    lane = take("gen", spec.pipelines)
                    chain = [(f"rollout{lane * k_stages + k}", k) for k in range(k_stages)]
                else:
                    chain = [(str(spec.generators[take("gen", spec.rollout_workers)]), None)]
                base = f"gen:{tag}" if samples is None else f"gen:{tag}:k{part}"
                images = len(tg) * (spec.group_size if samples is None else samples[1] - samples[0])
                version, prev = held[chain[0][0]], ()
                for worker, k in chain:
                    tid = base if k is None else f"{base}:s{k}"
                    rows.append((tid, "generate", (worker,), step, deps + prev, tg, version, images,
                                 None if k is None else (bounds[k], bounds[k + 1]),
                                 k is None or k == k_stages - 1, k, None, samples, 0))
                    prev = (tid,)
                finals.append((prev[0], worker, images))
            rw = f"reward{take('reward', spec.reward_workers)}" if spec.reward_workers else finals[-1][1]
            rows.append((f"reward:{tag}", "reward", (rw,), step, tuple(f[0] for f in finals), tg, 0,
                         sum(f[2] for f in finals), None, True, None, None, None, 0))
            position[f"reward:{tag}"], first_worker[f"reward:{tag}"] = len(rows), finals[0][1]
            reward_of.update({g: f"reward:{tag}" for g in tg})

    def train(step: int, groups: list[int]) -> None:
        whole = tuple(sorted({reward_of[g] for g in groups}))
        order = sorted(groups, key=lambda g: position[reward_of[g]])
        ids = []
        mini_groups = spec.groups_per_step // spec.mini_batches  # a PPO mini-batch: whole micro-batches
        previous: tuple[str, ...] = ()  # the previous mini-batch's optimizer step
        for j, mb in enumerate(chunk(order, spec.train_micro_batch_groups)):
            mini = j * spec.train_micro_batch_groups // mini_groups
            deps = (tuple(sorted({reward_of[g] for g in mb})) if spec.gap else whole) + previous
            if spec.fsdp:
                placed = [(tuple(trainers), None)]
            elif spec.placement == "colocated":
                placed = [((first_worker[reward_of[mb[0]]],), None)]
            elif spec.train_split == "timestep":
                placed = [((w,), (r, len(trainers))) for r, w in enumerate(trainers)]
            else:
                placed = [((trainers[j % len(trainers)],), None)]
            for workers, part in placed:
                ids.append(f"train:{step}:{j}" + (f":p{part[0]}" if part else ""))
                rows.append((ids[-1], "train", workers, step, deps, mb, 0, len(mb) * spec.group_size, None, True,
                             None, part, None, mini))
            if (j + 1) * spec.train_micro_batch_groups % mini_groups == 0:  # the mini-batch is complete
                last = mini == spec.mini_batches - 1
                opt = f"opt:{step}" if last else f"opt:{step}:m{mini}"
                rows.append((opt, "optimizer_step", tuple(trainers), step, tuple(ids), (),
                             step + 1 if last else step, 0, None, True, None, None, None, mini))
                previous, ids = (opt,), []
        for w in trainers:
            held[w] = step + 1

    # TAG's share: whole generate tasks; FSDP trainers take equal sample slices of whole calls
    # (gcd(ranks, calls per group) per task's groups), as many on every rank
    tag_split = 1
    if spec.fsdp and spec.tag:
        per_call = call_rows(spec.group_size, spec.train_micro_batch_groups, spec.trainer_workers, spec.sample_split)
        tag_split = math.gcd(spec.trainer_workers, spec.group_size // per_call)
    unit = spec.groups_per_task * (spec.trainer_workers // tag_split if spec.fsdp else 1)

    def lookahead_groups(step: int, share: int) -> list[int]:
        """The one-step-off pipeline: the whole next step on the previous weights but the
        trainers' TAG share (its last groups)."""
        return group_ids(step, spec.groups_per_step)[: spec.groups_per_step - min(share, spec.groups_per_step) // unit * unit]

    shares = _tag_shares(spec)
    for i, (step, share) in enumerate(zip(range(start, start + STEPS), shares)):
        groups = group_ids(step, spec.groups_per_step)
        planned_ahead = set(ahead.pop(step, []))
        rest = [g for g in groups if g not in planned_ahead]
        keep = len(rest) - min(share, len(rest)) // unit * unit  # the trainers take the last groups
        generate(step, rest[keep:], True, ())
        synced = any(r[0] == f"sync:{step}" for r in rows)
        generate(step, rest[:keep], False, (f"sync:{step}",) if synced else ())
        train(step, groups)
        if spec.placement == "disaggregated":
            if spec.max_staleness and i + 1 < STEPS:
                ahead[step + 1] = lookahead_groups(step + 1, shares[i + 1])
                generate(step + 1, ahead[step + 1], False, ())
            rollouts = tuple(f"rollout{r}" for r in range(spec.rollout_workers))
            rows.append((f"sync:{step + 1}", "sync", rollouts, step, (f"opt:{step}",), (), step + 1, 0,
                         None, True, None, None, None, 0))
            for w in rollouts:
                held[w] = step + 1
    return rows


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=lambda m: "-".join(map(str, m)))
def test_every_combination_plans_what_the_rules_say(mechanism):
    specs = _specs(*mechanism)
    if not specs:
        # Not a combination the strategy rules accept (e.g. TSP when colocated): nothing to plan.
        with pytest.raises(ValueError):
            StrategySpec(placement=mechanism[0], rollout_workers=4, trainer_workers=2, groups_per_step=8, group_size=2,
                         gap=mechanism[1], max_staleness=mechanism[2], tsp_stages=mechanism[3],
                         train_split=mechanism[4], tag=mechanism[5], fsdp=mechanism[6])
        return
    for spec, start in itertools.product(specs, (0, 2)):
        plan = _planned(spec, start)
        plan.check(complete_steps=range(start, start + STEPS))
        assert _rows(plan.tasks) == reference_plan(spec, start), (spec, start)


def test_the_grid_covers_every_mechanism():
    specs = [s for m in MECHANISMS for s in _specs(*m)]
    names = {part for s in specs for part in s.name.split("+")}
    assert names >= {"colocated", "fsdp", "disaggregated", "gap", "tsp2", "tsp_train", "tag", "tcss", "mb2", "mb3"}
    assert any(s.sample_split > 1 for s in specs) and any(s.reward_workers for s in specs)
    assert len(specs) > 400


@pytest.mark.parametrize("mechanism", [m for m in MECHANISMS if _specs(*m)][::5], ids=lambda m: "-".join(map(str, m)))
def test_task_ids_name_their_task_and_plans_look_tasks_up_by_them(mechanism):
    for spec in _specs(*mechanism):
        plan = _planned(spec, 0)
        texts = [str(t.id) for t in plan.tasks]
        assert len(set(texts)) == len(texts) == len({t.id for t in plan.tasks})  # one text per id
        for t in plan.tasks:
            assert plan[t.id] is t and all(d in plan for d in t.deps)
            assert isinstance(t.id, TaskId) and t.id.kind == t.kind
            if t.kind in (TaskKind.GENERATE, TaskKind.REWARD):
                assert t.id.groups == t.groups
            if t.kind == TaskKind.GENERATE:
                assert t.id.stage == t.stage and (t.id.sample_slice is None) == (t.samples is None)
            if t.kind in (TaskKind.TRAIN, TaskKind.OPTIMIZER_STEP):
                assert t.id.step == t.step
            if t.kind == TaskKind.OPTIMIZER_STEP:  # the last mini-batch's step has no index: it makes the version
                assert t.id.mini_batch == (None if t.mini_batch == spec.mini_batches - 1 else t.mini_batch)
            if t.kind == TaskKind.TRAIN:
                assert t.id.part == (t.train_part[0] if t.train_part else None)
            if t.kind == TaskKind.SYNC:
                assert t.id.version == t.version == t.step + 1
        assert plan[TaskId.optimizer_step(STEPS - 1)].kind == TaskKind.OPTIMIZER_STEP


def test_task_id_text_forms_and_order():
    assert [str(i) for i in (
        TaskId.generate((4, 5)), TaskId.generate((3,), sample_slice=1), TaskId.generate((3,), sample_slice=1, stage=2),
        TaskId.generate((7,), stage=0), TaskId.reward((4, 5)), TaskId.train(2, 3), TaskId.train(2, 3, part=1),
        TaskId.optimizer_step(2), TaskId.optimizer_step(2, 0), TaskId.sync(3),
    )] == ["gen:4-5", "gen:3:k1", "gen:3:k1:s2", "gen:7:s0", "reward:4-5", "train:2:3", "train:2:3:p1", "opt:2",
           "opt:2:m0", "sync:3"]
    assert TaskId.reward((1,)) == TaskId.reward((1,)) != TaskId.generate((1,))
    assert len({TaskId.sync(1), TaskId.sync(1), TaskId.optimizer_step(1)}) == 2
    # Ids order as their text does (the executor's input order for a micro-batch depends on it).
    ids = [TaskId.generate((g,)) for g in (2, 10, 9, 11)]
    assert [str(i) for i in sorted(ids)] == sorted(str(i) for i in ids) == ["gen:10", "gen:11", "gen:2", "gen:9"]


def test_a_planner_keeps_its_rotations_when_the_spec_is_rebalanced():
    """A re-balanced TSP spec changes stage boundaries from the next step on; the pipelines keep
    taking turns where they were."""
    import dataclasses

    spec = StrategySpec("disaggregated", rollout_workers=4, trainer_workers=1, groups_per_step=3, group_size=2,
                        gap=True, tsp_stages=2, num_steps=8)
    planner = StepPlanner(spec)
    planner.plan_step(0)
    planner.spec = dataclasses.replace(spec, stage_bounds=(0, 6, 8))
    planner.plan_step(1, has_next=False)
    planner.plan.check()
    firsts = [t for t in planner.plan.of_kind(TaskKind.GENERATE) if t.stage == 0]
    assert [t.worker.rank for t in firsts] == [0, 2, 0, 2, 0, 2]  # 3 groups a step over 2 pipelines
    assert {t.denoise for t in firsts if t.step == 0} == {(0, 4)}
    assert {t.denoise for t in firsts if t.step == 1} == {(0, 6)}
    assert WorkerId("rollout", 3) in {t.worker for t in planner.plan.tasks}
