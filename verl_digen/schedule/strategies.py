"""Strategies: how one training step is laid out as tasks on workers.

- colocated: every device is a fused worker (generate -> reward -> train); the optimizer
  step all-reduces over all of them and weights change in place (no sync).
- disaggregated: rollout, trainer and optional reward pools. Without GAP the trainers wait
  for the whole batch; with GAP (``gap``) each micro-batch trains as soon as its groups are
  rewarded. With ``max_staleness=1`` (TCSS) rollout generates the whole next step on the
  previous weights while the trainers train this one (with TAG: the first groups, during the
  drain), then receives the new weights; the sync never stops the trainers.

:class:`StepPlanner` appends one step at a time to a growing :class:`Plan`, so the
controller can re-plan with measured costs while the executor is running. It composes one
mechanism per question of a step plan (:mod:`verl_digen.schedule.mechanisms`), chosen from the
spec by :func:`layout_of`: a new mechanism is a class there and a line here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from verl_digen.schedule.mechanisms import (
    AfterStep,
    FsdpGang,
    Generation,
    Lookahead,
    OwnGroups,
    PipelineGeneration,
    PulledGeneration,
    PulledTrainers,
    RewardInPlace,
    RewardPlacement,
    RewardPool,
    RoundRobinGeneration,
    RoundRobinRollout,
    RoundRobinTrainers,
    Stage,
    StepCosts,  # noqa: F401  (re-exported: the schedule package's public names)
    TimestepSplit,
    TrainPlacement,
    TrainWaits,
    Turns,
    WeightSync,
    WhereGenerated,
    WholeStep,
)
from verl_digen.schedule.plan import Plan, Task, TaskId, TaskKind, WorkerId, chunk, group_ids, sample_slices


PLACEMENTS = ("colocated", "disaggregated")
TRAIN_SPLITS = ("sample", "timestep")


def strategy_violations(
    *,
    placement: str,
    rollout_workers: int | None,
    groups_per_step: int,
    groups_per_task: int = 1,
    train_micro_batch_groups: int = 1,
    max_staleness: int = 0,
    tsp_stages: int = 1,
    num_steps: int = 8,
    mini_batches: int = 1,
    train_split: str = "sample",
    tag: bool = False,
    fsdp: bool = False,
    stage_bounds: tuple[int, ...] | None = None,
    gat: bool = False,
    pull: bool = False,
    sample_slices: int | None = None,
    train_slices: int = 1,
    group_size: int | None = None,
    train_micro_batch_rows: int | None = None,
    name: Callable[[str], str] = str,
) -> list[tuple[str, str]]:
    """The broken invariants of a strategy as ``(field, what is valid)`` pairs; empty if none.

    The one copy of these rules: :class:`StrategySpec` raises ``ValueError`` on them, and
    ``DigenConfig.validate`` reports them against the ``digen.*`` key of the field. ``name``
    maps a field to how messages refer to it (the field name itself, or its config key).
    ``rollout_workers=None``: not known yet (colocated: the cluster's device count).
    ``stage_bounds=None``: an even split, valid whenever ``tsp_stages`` is.
    """
    if placement not in PLACEMENTS:
        return [("placement", f"valid: {', '.join(PLACEMENTS)}")]
    out: list[tuple[str, str]] = []
    if train_split not in TRAIN_SPLITS:
        out.append(("train_split", f"valid: {', '.join(TRAIN_SPLITS)}"))
    if placement == "colocated":
        needs = f"needs {name('placement')}=disaggregated"
        for field, used, what in (
            ("max_staleness", max_staleness != 0, "async (TCSS)"),
            ("tsp_stages", tsp_stages > 1, "TSP"),
            ("train_split", train_split == "timestep", "the TSP training split"),
            ("tag", tag, "TAG"),
            ("gat", gat, "GAT"),
            ("pull", pull, "pulling work units"),
            ("sample_slices", sample_slices is not None, "a fixed sample split"),
        ):
            if used:
                out.append((field, f"{what} {needs}"))
        if fsdp and rollout_workers is not None and groups_per_step % (groups_per_task * rollout_workers):
            # Every fused worker's forwards are FSDP collectives: each must generate as many
            # tasks of the same size as the others, every step.
            out.append(("groups_per_step", f"colocated FSDP needs a multiple of {name('groups_per_task')} x the "
                                           f"{rollout_workers} fused workers = {groups_per_task * rollout_workers}"))
    if not 1 <= tsp_stages <= num_steps:
        out.append(("tsp_stages", f"must be in [1, {name('num_steps')}={num_steps}]"))
    elif rollout_workers is not None and rollout_workers % tsp_stages:
        out.append(
            ("tsp_stages", f"must divide {name('rollout_workers')}={rollout_workers} (pipelines of whole stages)")
        )
    elif stage_bounds is not None:
        b = tuple(stage_bounds)
        if len(b) != tsp_stages + 1 or b[0] != 0 or b[-1] != num_steps or any(x >= y for x, y in zip(b, b[1:])):
            out.append(("stage_bounds", f"must rise strictly from 0 to {name('num_steps')}={num_steps} in "
                                        f"{name('tsp_stages')}={tsp_stages} stages"))
    if gat and placement == "disaggregated":
        # GAT: rollout workers train whole micro-batches on the weights they hold, which are the
        # trainers' only before the step's first optimizer step; TAG's trainers generating with
        # the same weights is the opposite direction, not both at once.
        if tag:
            out.append(("gat", f"GAT cannot be combined with TAG (the opposite direction); turn off {name('tag')}"))
        if train_split != "sample":
            out.append(("gat", f"GAT trains whole micro-batches; needs {name('train_split')}=sample"))
    out += _unit_violations(pull=pull, sample_slices=sample_slices, train_slices=train_slices, group_size=group_size,
                            tsp_stages=tsp_stages, fsdp=fsdp, train_split=train_split,
                            train_micro_batch_groups=train_micro_batch_groups, name=name)
    if train_micro_batch_rows is not None and (train_micro_batch_rows < 1 or (
            group_size is not None and group_size % train_micro_batch_rows)):
        # rows per training pass: a transformer call of the rollout's, within one group (call_rows
        # also needs it to divide a sample slice and to deal over the FSDP ranks; it names those)
        out.append(("train_micro_batch_rows", f"must be >= 1 and divide {name('group_size')}={group_size} (a pass "
                                              f"is a transformer call within one group; null: the largest that fits)"))
    for field, v in (("groups_per_task", groups_per_task), ("train_micro_batch_groups", train_micro_batch_groups)):
        if v < 1 or groups_per_step % v:
            valid = f"must be >= 1 and divide {name('groups_per_step')}={groups_per_step} (whole groups only)"
            out.append((field, valid))
    if mini_batches < 1 or groups_per_step % mini_batches:
        out.append(("mini_batches", f"must be >= 1 and divide {name('groups_per_step')}={groups_per_step} "
                                    "(mini-batches of whole groups)"))
    elif train_micro_batch_groups >= 1 and (groups_per_step // mini_batches) % train_micro_batch_groups:
        out.append(("train_micro_batch_groups", f"must divide the {groups_per_step // mini_batches} groups of a "
                                                f"PPO mini-batch ({name('groups_per_step')} / {name('mini_batches')})"))
    return out


def _unit_violations(*, pull: bool, sample_slices: int | None, train_slices: int, group_size: int | None,
                     tsp_stages: int, fsdp: bool, train_split: str, train_micro_batch_groups: int,
                     name: Callable[[str], str]) -> list[tuple[str, str]]:
    """The rules of the work units: pulled tasks, a fixed sample split, training row slices."""
    out: list[tuple[str, str]] = []
    if pull and tsp_stages > 1:
        out.append(("pull", f"a TSP pipeline chains its stages on fixed workers; pulled units need {name('tsp_stages')}=1"))
    if sample_slices is not None and (sample_slices < 1 or (group_size is not None and group_size % sample_slices)):
        out.append(("sample_slices", f"must be >= 1 and divide {name('group_size')}={group_size} (equal slices)"))
    if train_slices < 1:
        out.append(("train_slices", "must be >= 1"))
    elif train_slices > 1:
        if not pull:
            out.append(("train_slices", f"row slices are pulled by the free trainers; set {name('pull')}=true"))
        if fsdp:
            out.append(("train_slices", "an FSDP gang already splits each micro-batch's rows over every rank"))
        if train_split != "sample":
            out.append(("train_slices", f"slices a micro-batch by rows; needs {name('train_split')}=sample"))
        rows = train_micro_batch_groups * (group_size or 0)
        if group_size is not None and rows % train_slices:
            out.append(("train_slices", f"must divide a micro-batch's {rows} rows ({name('train_micro_batch_groups')} "
                                        f"x {name('group_size')}) into whole transformer calls"))
    return out


def fsdp_rows_split(train_micro_batch_groups: int, group_size: int, trainer_workers: int) -> bool:
    """Whether a micro-batch's rows split evenly over the FSDP trainer ranks, as the lockstep
    gang needs (every rank takes the same share of each micro-batch)."""
    return (train_micro_batch_groups * group_size) % trainer_workers == 0


def sample_split(groups_per_step: int, groups_per_task: int, group_size: int, lanes: int,
                 fixed: int | None = None) -> int:
    """Generate tasks per unit of ``groups_per_task`` groups: ``fixed`` when set
    (``digen.units.sample_slices``); else 1 when the step has at least as many
    units as rollout lanes (workers, or TSP pipelines); otherwise each unit is cut into that many
    equal sample slices, the largest divisor of ``group_size`` not above ``lanes // units``, so
    that every lane generates every step. Equal slices keep every transformer call the same
    rows in rollout and training (:func:`call_rows`)."""
    if fixed is not None:
        return fixed
    units = groups_per_step // groups_per_task
    if units >= lanes:
        return 1
    return max(d for d in range(1, group_size + 1) if group_size % d == 0 and d <= lanes // units)


def tag_split(group_size: int, trainer_workers: int, rows: int) -> int:
    """TAG's generate tasks per chunk of ``groups_per_task`` groups on FSDP trainers (trainers
    that hold the whole model take whole groups). Every rank must generate as many equal tasks
    (its forwards are collectives, in lockstep with the other ranks), so a group is cut into
    equal sample slices, as many as divide the ranks, each a whole number of the run's
    transformer calls (``rows`` samples each: :func:`call_rows` stays what it is without TAG, so
    rollout and training keep their calls): ``gcd(ranks, group_size // rows)``."""
    return math.gcd(trainer_workers, group_size // rows)


def tag_unit(groups_per_task: int, trainer_workers: int, fsdp: bool, split: int) -> int:
    """TAG's share of a step comes in multiples of this many groups: whole generate tasks; on
    FSDP trainers, as many of them (``split`` per chunk of groups) on every rank."""
    return groups_per_task * trainer_workers // split if fsdp else groups_per_task


def call_rows(group_size: int, micro_batch_groups: int, ranks: int, split: int = 1,
              rows_per_pass: int | None = None) -> int:
    """Rows per transformer call for rollout and training alike: the largest divisor ``m`` of a
    sample slice (``group_size // split`` rows; the whole group when not split) such that a
    training micro-batch (``micro_batch_groups * group_size`` rows) splits into whole chunks of
    ``m`` rows evenly over ``ranks`` FSDP ranks (1: no FSDP). ``rows_per_pass``
    (``digen.batch.train_micro_batch_rows``) chooses ``m`` among those instead of the largest:
    a training pass (one forward + backward, the gradient-accumulation unit) of fewer rows than
    a group; the micro-batch's advantages are still those of its whole groups.

    Why one number for both sides: a kernel's result for one row can depend on how many rows it
    is computed with, so exact on-policy log-probs need the trainer to make the rollout's calls.

    Raises ``ValueError`` naming the keys when the micro-batch's rows do not split evenly, or
    when ``rows_per_pass`` is not one of the valid sizes (the message lists them)."""
    rows = micro_batch_groups * group_size
    if rows % ranks:
        raise ValueError(
            f"digen.batch.train_micro_batch_groups={micro_batch_groups} x digen.batch.group_size={group_size} "
            f"= {rows} rows do not split evenly over {ranks} FSDP ranks"
        )
    part = group_size // split
    valid = [m for m in range(1, part + 1) if part % m == 0 and (rows // m) % ranks == 0]
    if rows_per_pass is None:
        return max(valid)
    if rows_per_pass not in valid:
        raise ValueError(
            f"digen.batch.train_micro_batch_rows={rows_per_pass} must be one of {', '.join(map(str, valid))}: a "
            f"training pass is one transformer call of the rollout's, which divides a sample slice of "
            f"{part} rows (digen.batch.group_size={group_size} / {split} slices) and deals the micro-batch's "
            f"{rows} rows in whole calls over {ranks} rank(s); set one of them, or null for the largest"
        )
    return rows_per_pass


def pass_rows(group_size: int, micro_batch_groups: int, fsdp_ranks: int, groups_per_step: int,
              groups_per_task: int, rollout_lanes: int, sample_slices: int | None = None,
              train_slices: int = 1, rows_per_pass: int | None = None) -> int:
    """Samples per transformer call of a run, in rollout and in a training pass alike: the
    :func:`call_rows` of its sample split (:func:`sample_split` over ``rollout_lanes``, or
    ``sample_slices``), its micro-batch's rows dealt over the FSDP ranks or the training row
    slices (TAG's slices are whole calls: :func:`tag_split`). A training micro-batch runs one
    forward + backward per call (``workers/training.py``), so this is what bounds training
    activations, in the code, the memory planner and the cost model."""
    split = sample_split(groups_per_step, groups_per_task, group_size, rollout_lanes, sample_slices)
    return call_rows(group_size, micro_batch_groups, fsdp_ranks * train_slices, split, rows_per_pass)


@dataclass(frozen=True)
class StrategySpec:
    placement: str  # colocated | disaggregated
    rollout_workers: int  # colocated: the number of fused workers
    trainer_workers: int  # colocated: ignored (= rollout_workers)
    groups_per_step: int
    group_size: int
    reward_workers: int = 0  # 0: reward runs on the worker that generated
    groups_per_task: int = 1
    train_micro_batch_groups: int = 1
    # Rows per training pass (one forward + backward on a rank, a transformer call of the
    # rollout's too): digen.batch.train_micro_batch_rows; None: the largest :func:`call_rows` allows.
    train_micro_batch_rows: int | None = None
    gap: bool = False
    max_staleness: int = 0
    # TSP rollout: pipelines of tsp_stages rollout workers over the denoising steps;
    # stage_bounds are the K+1 step boundaries (None: an even split of num_steps).
    tsp_stages: int = 1
    num_steps: int = 8
    stage_bounds: tuple[int, ...] | None = None
    # TSP training: "sample" (a micro-batch per rank) or "timestep" (every rank takes a
    # share of each micro-batch's trained steps).
    train_split: str = "sample"
    # TAG: trainer workers generate part of each step's groups (the share is per step).
    tag: bool = False
    # FSDP over the training ranks (trainers; fused workers when colocated): each micro-batch is
    # a gang task on every rank (lockstep), each rank taking a share of its samples.
    fsdp: bool = False
    # PPO mini-batches: optimizer steps per training step, each on groups_per_step / mini_batches
    # groups (veRL's ppo_mini_batch_size); weights versions still count training steps.
    mini_batches: int = 1
    # GAT (generator-assisted training, TAG reversed): rollout workers train some micro-batches of
    # the step's first PPO mini-batch with the weights they hold (the trainers' version) and
    # send the gradients to the trainers, which add them before their optimizer step (LoRA runs:
    # the gradients are megabytes). How many is decided per step (schedule/elastic.py).
    gat: bool = False
    # Work units (disaggregated): ``pull``: generate, reward and train tasks are taken by whichever
    # worker of their pool is free next (not dealt round-robin when planned); ``sample_slices``:
    # generate tasks per group (None: :func:`sample_split` decides); ``train_slices``: pulled row
    # slices per trainer micro-batch (whole transformer calls each).
    pull: bool = False
    sample_slices: int | None = None
    train_slices: int = 1

    def __post_init__(self) -> None:
        problems = strategy_violations(
            placement=self.placement, rollout_workers=self.rollout_workers, groups_per_step=self.groups_per_step,
            groups_per_task=self.groups_per_task, train_micro_batch_groups=self.train_micro_batch_groups,
            max_staleness=self.max_staleness, tsp_stages=self.tsp_stages, num_steps=self.num_steps,
            train_split=self.train_split, tag=self.tag, fsdp=self.fsdp, stage_bounds=self.stage_bounds,
            mini_batches=self.mini_batches, gat=self.gat, pull=self.pull, sample_slices=self.sample_slices,
            train_slices=self.train_slices, group_size=self.group_size,
            train_micro_batch_rows=self.train_micro_batch_rows,
        )
        if self.tag and self.fsdp and self.placement == "disaggregated" and not fsdp_rows_split(
                self.train_micro_batch_groups, self.group_size, self.trainer_workers):
            # TAG's slices are whole calls of the gang's rows (tag_split); the config reports it
            # against digen.batch.train_micro_batch_groups (DigenConfig.validate)
            problems.append(("train_micro_batch_groups", f"x group_size={self.group_size} rows must split evenly "
                                                         f"over the {self.trainer_workers} FSDP trainer ranks"))
        if problems:
            raise ValueError("; ".join(f"{name}={getattr(self, name)!r}: {valid}" for name, valid in problems))

    @property
    def bounds(self) -> tuple[int, ...]:
        if self.stage_bounds is not None:
            return tuple(self.stage_bounds)
        k, n = self.tsp_stages, self.num_steps
        return tuple(round(i * n / k) for i in range(k + 1))

    @property
    def tag_split(self) -> int:
        """TAG's generate tasks per chunk of ``groups_per_task`` groups (:func:`tag_split`)."""
        if not (self.tag and self.fsdp):
            return 1
        rows = call_rows(self.group_size, self.train_micro_batch_groups, self.trainer_workers, self.sample_split,
                         self.train_micro_batch_rows)
        return tag_split(self.group_size, self.trainer_workers, rows)

    @property
    def tag_unit(self) -> int:
        """TAG's share of a step comes in multiples of this many groups (:func:`tag_unit`)."""
        return tag_unit(self.groups_per_task, self.trainer_workers, self.fsdp, self.tag_split)

    @property
    def micro_batches_per_mini_batch(self) -> int:
        """Training micro-batches in each PPO mini-batch (GAT takes at most the first's)."""
        return self.groups_per_step // self.mini_batches // self.train_micro_batch_groups

    @property
    def pipelines(self) -> int:
        return self.rollout_workers // self.tsp_stages

    @property
    def sample_split(self) -> int:
        """Generate tasks per unit of ``groups_per_task`` groups: see :func:`sample_split`."""
        return sample_split(self.groups_per_step, self.groups_per_task, self.group_size, self.pipelines,
                            self.sample_slices)

    @property
    def name(self) -> str:
        mini = f"+mb{self.mini_batches}" if self.mini_batches > 1 else ""
        return self._mechanisms() + mini

    def _mechanisms(self) -> str:
        if self.placement == "colocated":
            return "colocated+fsdp" if self.fsdp else "colocated"
        parts = ["disaggregated"]
        if self.gap:
            parts.append("gap")
        if self.tsp_stages > 1:
            parts.append(f"tsp{self.tsp_stages}")
        if self.train_split == "timestep":
            parts.append("tsp_train")
        if self.tag:
            parts.append("tag")
        if self.gat:
            parts.append("gat")
        if self.pull:
            parts.append("pull" if self.train_slices == 1 else f"pull{self.train_slices}")
        if self.fsdp:
            parts.append("fsdp")
        if self.max_staleness:
            parts.append("tcss")
        return "+".join(parts)

    @property
    def devices(self) -> int:
        if self.placement == "colocated":
            return self.rollout_workers + self.reward_workers
        return self.rollout_workers + self.trainer_workers + self.reward_workers

    def workers(self) -> list[WorkerId]:
        if self.placement == "colocated":
            ws = [WorkerId("fused", r) for r in range(self.rollout_workers)]
        else:
            ws = [WorkerId("rollout", r) for r in range(self.rollout_workers)]
            ws += [WorkerId("trainer", r) for r in range(self.trainer_workers)]
        ws += [WorkerId("reward", r) for r in range(self.reward_workers)]  # colocated too: a reward pool beside fused workers
        return ws

    @property
    def generators(self) -> list[WorkerId]:
        pool = "fused" if self.placement == "colocated" else "rollout"
        return [WorkerId(pool, r) for r in range(self.rollout_workers)]

    @property
    def trainers(self) -> list[WorkerId]:
        if self.placement == "colocated":
            return self.generators
        return [WorkerId("trainer", r) for r in range(self.trainer_workers)]


@dataclass(frozen=True)
class StepLayout:
    """A step plan's mechanisms, one per question (see :mod:`verl_digen.schedule.mechanisms`)."""

    generation: Generation  # the step's groups on the generators
    assist: Generation | None  # TAG: the trainers' share (None: TAG off)
    reward: RewardPlacement
    waits: TrainWaits
    training: TrainPlacement
    assisted_training: TrainPlacement | None  # GAT: the rollout pool's micro-batches (None: GAT off)
    after_step: tuple[AfterStep, ...]


def layout_of(spec: StrategySpec) -> StepLayout:
    """The mechanisms ``spec`` switches on: the one place the planner reads its switches."""
    trainers = tuple(spec.trainers)
    if spec.tsp_stages > 1:
        generation: Generation = PipelineGeneration(spec.pipelines, spec.bounds, spec.sample_split)
    elif spec.pull:
        generation = PulledGeneration(tuple(spec.generators), spec.sample_split)
    else:
        generation = RoundRobinGeneration(tuple(spec.generators), spec.sample_split, "generate")
    return StepLayout(
        generation=generation,
        # TAG tasks take whole groups (trainers are few, and they train right after); FSDP
        # trainers equal sample slices of them, as many per rank (StrategySpec.tag_split)
        assist=RoundRobinGeneration(trainers, spec.tag_split, "tag") if spec.tag else None,
        reward=RewardPool(spec.reward_workers, spec.pull) if spec.reward_workers else RewardInPlace(),
        waits=OwnGroups() if spec.gap else WholeStep(),
        training=_training_of(spec, trainers),
        assisted_training=RoundRobinRollout(spec.rollout_workers, spec.pull) if spec.gat else None,
        after_step=_after_step_of(spec),
    )


def _training_of(spec: StrategySpec, trainers: tuple[WorkerId, ...]) -> TrainPlacement:
    """Where micro-batches train; FSDP first: its gang spans fused workers too when colocated."""
    if spec.fsdp:
        return FsdpGang(trainers)
    if spec.placement == "colocated":
        return WhereGenerated()
    if spec.train_split == "timestep":
        return TimestepSplit(trainers)
    if spec.pull:
        return PulledTrainers(trainers, spec.train_slices)
    return RoundRobinTrainers(trainers)


def _after_step_of(spec: StrategySpec) -> tuple[AfterStep, ...]:
    """Colocated: nothing (weights change in place); disaggregated: the TCSS look-ahead (planned
    before the sync it runs ahead of), then the weight sync."""
    if spec.placement == "colocated":
        return ()
    lookahead: tuple[AfterStep, ...] = ()
    if spec.max_staleness >= 1:
        # the whole next step (one-step-off) but TAG's share of it
        lookahead = (Lookahead(spec.groups_per_step),)
    return (*lookahead, WeightSync(spec.rollout_workers))


class StepPlanner:
    """Appends the tasks of one training step at a time to ``self.plan``, composing the
    mechanisms of ``layout_of(spec)``."""

    def __init__(self, spec: StrategySpec, *, start_step: int = 0) -> None:
        """``start_step > 0`` continues a resumed run: every worker holds version ``start_step``."""
        self.spec = spec
        self.plan = Plan(workers=spec.workers(), max_staleness=spec.max_staleness, start_version=start_step)
        self._turns = Turns()
        # Generate tasks of step s+1 already planned ahead of SYNC(s+1) (TCSS): step -> groups.
        self._planned_ahead: dict[int, list[int]] = {}
        self._version: dict[WorkerId, int] = {w: start_step for w in self.plan.workers}
        self._reward_of: dict[int, Task] = {}  # group -> its reward task
        self._gen_of: dict[int, Task] = {}  # first group of a generate task -> its first final task
        self._position: dict[TaskId, int] = {}  # reward task id -> index in the plan
        self.next_tag_groups = 0  # TAG's share of the step after the one being planned (TCSS)

    @property
    def spec(self) -> StrategySpec:
        return self._spec

    @spec.setter
    def spec(self, spec: StrategySpec) -> None:
        """A new spec (re-balanced TSP stages) takes effect from the next planned task on."""
        self._spec = spec
        self.layout = layout_of(spec)

    # ----------------------------------------------------------------- public

    def plan_step(
        self, step: int, *, has_next: bool = True, tag_groups: int = 0, gat_micro_batches: int = 0,
        next_tag_groups: int = 0,
    ) -> list[Task]:
        """Append step ``step``; ``has_next=False`` for the last step (no look-ahead).

        ``tag_groups``: how many of the step's groups the trainers generate (TAG), decided by
        the caller's elastic policy; they are taken from the groups not generated ahead.
        ``next_tag_groups``: TAG's share of the next step, which the TCSS look-ahead leaves to
        the trainers (its last groups; the caller passes the same as ``tag_groups`` then).
        ``gat_micro_batches``: how many micro-batches the rollout workers train (GAT), the last
        ones of the step's first PPO mini-batch (those whose groups come last).
        """
        self.next_tag_groups = self._whole_tag_units(next_tag_groups, self.spec.groups_per_step)
        start = len(self.plan.tasks)
        groups = group_ids(step, self.spec.groups_per_step)
        ahead = set(self._planned_ahead.pop(step, []))
        remaining = [g for g in groups if g not in ahead]
        if tag_groups:
            remaining = self._assist(step, remaining, tag_groups)
        sync = TaskId.sync(step)
        self._add_generation(step, remaining, self.layout.generation, deps=(sync,) if sync in self.plan else ())
        self._add_training(step, groups, gat_micro_batches)
        for mechanism in self.layout.after_step:
            mechanism.after_step(self, step, has_next)
        return self.plan.tasks[start:]

    def add(self, task: Task) -> Task:
        """Append ``task``; track the weights version each worker will hold after it."""
        self.plan.add(task)
        if task.kind == TaskKind.OPTIMIZER_STEP:
            for w in task.workers:  # between mini-batches: still counted as the step's version
                self._version[w] = task.version
        elif task.kind == TaskKind.SYNC:
            for w in task.workers:
                if w.pool != "trainer":  # the sender already holds it
                    self._version[w] = task.version
        return task

    def generate_ahead(self, step: int, groups: list[int]) -> None:
        """Plan ``groups`` of ``step`` now, on the weights the generators hold (TCSS)."""
        self._planned_ahead[step] = groups
        self._add_generation(step, groups, self.layout.generation)

    # ----------------------------------------------------------------- pieces

    def _assist(self, step: int, remaining: list[int], tag_groups: int) -> list[int]:
        """TAG: the trainers generate the last ``tag_groups`` (whole tasks; FSDP trainers as many
        per rank, their forwards being collectives in lockstep: the groups the TCSS look-ahead
        leaves them); the rest remain."""
        if self.layout.assist is None:
            raise ValueError("tag_groups > 0 needs a StrategySpec with tag=True")
        keep = len(remaining) - self._whole_tag_units(tag_groups, len(remaining))
        self._add_generation(step, remaining[keep:], self.layout.assist)
        return remaining[:keep]

    def _whole_tag_units(self, groups: int, at_most: int) -> int:
        """``groups`` of TAG's share as the plan takes it: at most ``at_most``, in whole units
        (:attr:`StrategySpec.tag_unit`); the look-ahead and :meth:`_assist` agree through it."""
        unit = self.spec.tag_unit
        return min(groups, at_most) // unit * unit

    def _add_generation(
        self, step: int, groups: list[int], generation: Generation, *, deps: tuple[TaskId, ...] = ()
    ) -> None:
        """Generate + reward tasks for ``groups``, placed by ``generation``."""
        spec = self.spec
        for task_groups in chunk(groups, spec.groups_per_task):
            finals = [
                self._add_slice(step, task_groups, generation.stages(self._turns), part, samples, deps)
                for part, samples in enumerate(sample_slices(spec.group_size, generation.split))
            ]
            self._add_reward(step, task_groups, finals)

    def _add_slice(
        self, step: int, groups: tuple[int, ...], stages: tuple[Stage, ...], part: int,
        samples: tuple[int, int] | None, deps: tuple[TaskId, ...],
    ) -> Task:
        """One sample slice of ``groups`` (all samples when None) as a chain of ``stages``;
        returns its final task. Every stage generates with the first stage worker's weights
        (a pulled task: every candidate's, which are the same)."""
        held = {self._version[w] for w in stages[0].workers}
        if len(held) != 1:
            raise ValueError(f"a pulled generate task of groups {groups} would run on workers holding "
                             f"weights versions {sorted(held)}")
        version = held.pop()
        per_group = self.spec.group_size if samples is None else samples[1] - samples[0]
        gen: Task | None = None
        for stage in stages:
            gen = self.add(Task(
                id=TaskId.generate(groups, sample_slice=None if samples is None else part, stage=stage.index),
                kind=TaskKind.GENERATE, workers=stage.workers, step=step, pull=bool(stage.pulled_by),
                deps=deps + ((gen.id,) if gen else ()), groups=groups, version=version,
                images=len(groups) * per_group, denoise=stage.denoise, final=stage.final, stage=stage.index,
                samples=samples,
            ))
        assert gen is not None
        return gen

    def _add_reward(self, step: int, groups: tuple[int, ...], finals: list[Task]) -> None:
        """The reward scores whole groups: it waits for every sample slice (reassembly)."""
        workers, pull = self.layout.reward.place(finals, self._turns)
        rew = self.add(Task(
            id=TaskId.reward(groups), kind=TaskKind.REWARD, workers=workers, pull=pull,
            step=step, deps=tuple(g.id for g in finals), groups=groups, images=sum(g.images for g in finals),
        ))
        self._gen_of[groups[0]] = finals[0]
        self._position[rew.id] = len(self.plan.tasks)
        for g in groups:
            self._reward_of[g] = rew

    def _generated_on(self, group: int) -> WorkerId:
        """The worker that generated (the first slice of) ``group``'s generate task."""
        return self._gen_of[self._reward_of[group].groups[0]].worker

    def _add_training(self, step: int, groups: list[int], assisted: int = 0) -> None:
        """The step's micro-batches, in the order their groups become available (planned-ahead
        groups first), cut into PPO mini-batches of consecutive micro-batches; each mini-batch
        ends in its optimizer step, which the next mini-batch's micro-batches wait for. Only
        the last one makes the next weights version (``step + 1``). The last ``assisted``
        micro-batches of the first mini-batch train on the rollout pool (GAT)."""
        spec = self.spec
        whole_step = tuple(sorted({self._reward_of[g].id for g in groups}))
        order = sorted(groups, key=lambda g: self._position[self._reward_of[g].id])
        per_mini = spec.micro_batches_per_mini_batch
        train_ids: list[TaskId] = []
        previous: tuple[TaskId, ...] = ()  # the previous mini-batch's optimizer step
        first_assisted = per_mini - self._assisted_count(step, assisted, per_mini)
        for j, mb in enumerate(chunk(order, spec.train_micro_batch_groups)):
            mini = j // per_mini
            own = tuple(sorted({self._reward_of[g].id for g in mb}))
            deps = self.layout.waits.deps(own, whole_step) + previous
            placement = self.layout.training
            if mini == 0 and j >= first_assisted:
                placement = self.layout.assisted_training
            for unit in placement.parts(j, mb[0], self._generated_on):
                rows = len(mb) * spec.group_size
                t = self.add(Task(
                    id=TaskId.train(step, j, part=unit.part[0] if unit.part else None,
                                    rows=unit.rows[0] if unit.rows else None),
                    kind=TaskKind.TRAIN, workers=unit.workers, step=step, deps=deps, groups=mb,
                    images=rows // unit.rows[1] if unit.rows else rows, train_part=unit.part, mini_batch=mini,
                    row_part=unit.rows, pull=unit.pull,
                ))
                train_ids.append(t.id)
            if (j + 1) % per_mini == 0:
                last = mini == spec.mini_batches - 1
                opt = self.add(Task(
                    id=TaskId.optimizer_step(step, None if last else mini), kind=TaskKind.OPTIMIZER_STEP,
                    workers=tuple(spec.trainers), step=step, deps=tuple(train_ids),
                    version=step + 1 if last else step, mini_batch=mini,
                ))
                previous, train_ids = (opt.id,), []


    def _assisted_count(self, step: int, assisted: int, per_mini: int) -> int:
        """GAT's micro-batches of ``step`` (at most the first mini-batch's), checked: the rollout
        workers hold the trainers' weights of this step (version ``step``) until its sync."""
        if not assisted:
            return 0
        if self.layout.assisted_training is None:
            raise ValueError("gat_micro_batches > 0 needs a StrategySpec with gat=True")
        stale = sorted(str(w) for w, v in self._version.items() if w.pool == "rollout" and v != step)
        if stale:
            raise ValueError(f"GAT in step {step}: rollout workers {stale} do not hold version {step}")
        return min(assisted, per_mini)
