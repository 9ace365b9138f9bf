"""The mechanisms a step's plan is made of, one small object each.

A step plan answers five questions, and each mechanism is one answer to one of them:

- where a generate task runs: round-robin over a pool (:class:`RoundRobinGeneration`: the
  rollout workers, the fused workers, or the trainers under TAG), pulled by whichever rollout
  worker is free next (:class:`PulledGeneration`), or chained over a TSP pipeline's stages
  (:class:`PipelineGeneration`);
- where its reward runs: a reward pool (:class:`RewardPool`, round-robin or pulled) or where it
  was generated (:class:`RewardInPlace`: pulled by the generators when its generation was);
- what a training micro-batch waits for: its own groups' rewards (:class:`OwnGroups`, GAP) or
  the whole step's (:class:`WholeStep`);
- where it trains: every rank in lockstep (:class:`FsdpGang`), where it was generated
  (:class:`WhereGenerated`, colocated), a share of its time steps on every rank
  (:class:`TimestepSplit`), round-robin over the trainers (:class:`RoundRobinTrainers`) or in
  row slices pulled by whichever trainer is free next (:class:`PulledTrainers`); and under GAT,
  for the micro-batches the step gives them, round-robin over the rollout workers or pulled by
  them (:class:`RoundRobinRollout`);
- what follows the optimizer step: the TCSS look-ahead (:class:`Lookahead`) and the weight
  sync (:class:`WeightSync`), each through :class:`AfterStep`.

``strategies.layout_of`` picks one answer per question from a spec and
:class:`~verl_digen.schedule.strategies.StepPlanner` composes them, so a new mechanism is a
class here and one line there, not a branch in every method of the planner.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol

from verl_digen.schedule.plan import Task, TaskId, TaskKind, WorkerId, group_ids


@dataclass
class StepCosts:
    """Seconds per unit of work, measured or modelled. No plan depends on them (the TCSS
    look-ahead takes the whole next step); the steady-state simulator decides TAG with the
    modelled ones before a step is measured (``StepDriver(prior=...)``)."""

    generate_per_group: float = 1.0
    reward_per_group: float = 0.05
    train_per_group: float = 2.0
    optimizer_step: float = 0.05
    sync: float = 0.05


class Turns:
    """Round-robin positions, one per named rotation. The planner keeps them for the whole run,
    so a layout rebuilt for re-balanced TSP stages goes on where the old one stopped."""

    def __init__(self) -> None:
        self._taken: Counter[str] = Counter()

    def next(self, rotation: str, lanes: int) -> int:
        """The next lane of ``rotation`` (of ``lanes``), and advance it."""
        lane = self._taken[rotation] % lanes
        self._taken[rotation] += 1
        return lane


# ----------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class Stage:
    """One generate task of a sample slice: its worker and, under TSP, its denoising range."""

    worker: WorkerId
    index: int | None = None  # the TSP stage (None: every denoising step)
    denoise: tuple[int, int] | None = None
    final: bool = True  # decodes and completes the groups
    pulled_by: tuple[WorkerId, ...] = ()  # a pulled task's candidates (``worker`` is the first)

    @property
    def workers(self) -> tuple[WorkerId, ...]:
        return self.pulled_by or (self.worker,)


class Generation(Protocol):
    """Where generate tasks go: ``split`` sample slices per task, each a chain of stages."""

    split: int

    def stages(self, turns: Turns) -> tuple[Stage, ...]:
        """The chained tasks of the next sample slice, on the next lane."""
        ...


@dataclass(frozen=True)
class RoundRobinGeneration:
    """Whole-trajectory tasks round-robin over ``workers`` (rollout, fused, or trainers: TAG)."""

    workers: tuple[WorkerId, ...]
    split: int
    rotation: str

    def stages(self, turns: Turns) -> tuple[Stage, ...]:
        return (Stage(self.workers[turns.next(self.rotation, len(self.workers))]),)


@dataclass(frozen=True)
class PulledGeneration:
    """Whole-trajectory tasks (sample slices) taken by whichever of ``workers`` is free next, so
    a worker that finishes early takes the next unit instead of idling behind a slow one."""

    workers: tuple[WorkerId, ...]
    split: int

    def stages(self, turns: Turns) -> tuple[Stage, ...]:
        return (Stage(self.workers[0], pulled_by=self.workers),)


@dataclass(frozen=True)
class PipelineGeneration:
    """TSP: one chained task per stage, each on its own rollout worker of the next pipeline."""

    pipelines: int
    bounds: tuple[int, ...]  # the K+1 denoising-step boundaries
    split: int

    def stages(self, turns: Turns) -> tuple[Stage, ...]:
        lane = turns.next("generate", self.pipelines)  # the generators' rotation, as without TSP
        k = len(self.bounds) - 1
        return tuple(
            Stage(WorkerId("rollout", lane * k + i), i, (self.bounds[i], self.bounds[i + 1]), i == k - 1)
            for i in range(k)
        )


# ----------------------------------------------------------------------------- rewards


class RewardPlacement(Protocol):
    def place(self, finals: list[Task], turns: Turns) -> tuple[tuple[WorkerId, ...], bool]:
        """Where the reward of the groups generated by ``finals`` (their final tasks) runs: its
        worker, or its candidates and True when whichever is free first takes it."""
        ...


@dataclass(frozen=True)
class RewardPool:
    """A reward pool: round-robin, or pulled by whichever reward worker is free next."""

    workers: int
    pull: bool = False

    def place(self, finals: list[Task], turns: Turns) -> tuple[tuple[WorkerId, ...], bool]:
        if self.pull:
            return tuple(WorkerId("reward", r) for r in range(self.workers)), True
        return (WorkerId("reward", turns.next("reward", self.workers)),), False


@dataclass(frozen=True)
class RewardInPlace:
    """On the worker that generated the last sample slice: no reward pool. Pulled generation:
    pulled by the same candidates (the trajectories travel as object refs either way)."""

    def place(self, finals: list[Task], turns: Turns) -> tuple[tuple[WorkerId, ...], bool]:
        return finals[-1].workers, finals[-1].pull


# ----------------------------------------------------------------------------- training


class TrainWaits(Protocol):
    def deps(self, own: tuple[TaskId, ...], whole_step: tuple[TaskId, ...]) -> tuple[TaskId, ...]:
        """A micro-batch's dependencies, from its own groups' rewards and the whole step's."""
        ...


@dataclass(frozen=True)
class OwnGroups:
    """GAP: a micro-batch trains as soon as its own groups are rewarded."""

    def deps(self, own: tuple[TaskId, ...], whole_step: tuple[TaskId, ...]) -> tuple[TaskId, ...]:
        return own


@dataclass(frozen=True)
class WholeStep:
    """Without GAP: every micro-batch waits for the whole step's rewards."""

    def deps(self, own: tuple[TaskId, ...], whole_step: tuple[TaskId, ...]) -> tuple[TaskId, ...]:
        return whole_step


@dataclass(frozen=True)
class TrainUnit:
    """One train task of a micro-batch: its workers (a gang, or a pulled task's candidates), its
    time-step part ``(r, n)`` and its row slice ``(k, n)`` (None: all steps, all rows)."""

    workers: tuple[WorkerId, ...]
    part: tuple[int, int] | None = None
    rows: tuple[int, int] | None = None
    pull: bool = False


TrainParts = tuple[TrainUnit, ...]


class TrainPlacement(Protocol):
    def parts(self, index: int, first_group: int, generated_on: Callable[[int], WorkerId]) -> TrainParts:
        """The train tasks of micro-batch ``index`` (first group ``first_group``)."""
        ...


@dataclass(frozen=True)
class FsdpGang:
    """FSDP: one gang task on every training rank, in lockstep."""

    trainers: tuple[WorkerId, ...]

    def parts(self, index: int, first_group: int, generated_on: Callable[[int], WorkerId]) -> TrainParts:
        return (TrainUnit(self.trainers),)


@dataclass(frozen=True)
class WhereGenerated:
    """Colocated: train where the data was generated (no transfer between devices)."""

    def parts(self, index: int, first_group: int, generated_on: Callable[[int], WorkerId]) -> TrainParts:
        return (TrainUnit((generated_on(first_group),)),)


@dataclass(frozen=True)
class TimestepSplit:
    """TSP training: every rank takes a share of the micro-batch's steps, so a lone (drain)
    micro-batch still keeps all trainer ranks busy."""

    trainers: tuple[WorkerId, ...]

    def parts(self, index: int, first_group: int, generated_on: Callable[[int], WorkerId]) -> TrainParts:
        n = len(self.trainers)
        return tuple(TrainUnit((w,), part=(r, n)) for r, w in enumerate(self.trainers))


@dataclass(frozen=True)
class RoundRobinTrainers:
    """A micro-batch per trainer, in turn."""

    trainers: tuple[WorkerId, ...]

    def parts(self, index: int, first_group: int, generated_on: Callable[[int], WorkerId]) -> TrainParts:
        return (TrainUnit((self.trainers[index % len(self.trainers)],)),)


@dataclass(frozen=True)
class PulledTrainers:
    """A micro-batch in ``slices`` row slices (whole transformer calls each), every slice taken
    by whichever trainer is free next: a lone micro-batch at the end of a step still keeps
    ``slices`` trainers busy, and no trainer waits behind another's queue. The trainers' all-
    reduce at the optimizer step sums the slices wherever they ran (the same update, to float
    rounding)."""

    trainers: tuple[WorkerId, ...]
    slices: int = 1

    def parts(self, index: int, first_group: int, generated_on: Callable[[int], WorkerId]) -> TrainParts:
        if self.slices == 1:
            return (TrainUnit(self.trainers, pull=True),)
        return tuple(TrainUnit(self.trainers, rows=(k, self.slices), pull=True) for k in range(self.slices))


@dataclass(frozen=True)
class RoundRobinRollout:
    """GAT: the micro-batches the rollout pool trains (consecutive ones), one per rollout worker
    in turn, so they spread evenly whichever worker generated them; ``pull``: each taken by
    whichever rollout worker is free next instead."""

    rollout_workers: int
    pull: bool = False

    def parts(self, index: int, first_group: int, generated_on: Callable[[int], WorkerId]) -> TrainParts:
        if self.pull:
            return (TrainUnit(tuple(WorkerId("rollout", r) for r in range(self.rollout_workers)), pull=True),)
        return (TrainUnit((WorkerId("rollout", index % self.rollout_workers),)),)


# ----------------------------------------------------------------------------- after the optimizer step


class StepBuilder(Protocol):
    """What an :class:`AfterStep` mechanism may do to the plan being built."""

    def add(self, task: Task) -> Task: ...

    def generate_ahead(self, step: int, groups: list[int]) -> None: ...

    @property
    def next_tag_groups(self) -> int:
        """TAG's share of the next step (0: none, or not decided yet)."""
        ...


class AfterStep(Protocol):
    def after_step(self, plan: StepBuilder, step: int, has_next: bool) -> None:
        """Add what follows step ``step``'s optimizer step (``has_next``: another step follows)."""
        ...


@dataclass(frozen=True)
class Lookahead:
    """TCSS, the one-step-off pipeline: every group of step k+1 is generated with version k
    while the trainers train step k; version k+1 reaches the rollout workers after that (the
    sync waits only for them, :class:`WeightSync`). With TAG, the trainers' share of step k+1
    (decided when step k is planned, :class:`~verl_digen.schedule.driver.StepDriver`) is left
    out: they generate it with version k+1 after their optimizer step, while the rollout
    workers finish their share."""

    groups_per_step: int

    def after_step(self, plan: StepBuilder, step: int, has_next: bool) -> None:
        if has_next:
            plan.generate_ahead(step + 1, self.groups(step + 1, plan.next_tag_groups))

    def groups(self, next_step: int, tag_groups: int = 0) -> list[int]:
        """The next step's groups but its last ``tag_groups`` (the trainers')."""
        if not 0 <= tag_groups <= self.groups_per_step:
            raise ValueError(f"TAG share {tag_groups} of a step of {self.groups_per_step} groups")
        return group_ids(next_step, self.groups_per_step)[: self.groups_per_step - tag_groups]


@dataclass(frozen=True)
class WeightSync:
    """Disaggregated: the new weights reach every rollout worker after every step (the last
    too: rollout ends holding the final weights). The task occupies the receivers only: trainer
    0 sends from the copy it took at the optimizer step, on a side thread, once every receiver
    has reached the sync (``workers/worker.py: DiffusionWorker.optimizer_step``), so the trainers
    go on training while the rollout workers finish what they generate with the old version."""

    rollout_workers: int

    def after_step(self, plan: StepBuilder, step: int, has_next: bool) -> None:
        version = step + 1
        workers = tuple(WorkerId("rollout", r) for r in range(self.rollout_workers))
        plan.add(Task(id=TaskId.sync(version), kind=TaskKind.SYNC, workers=workers, step=step,
                      deps=(TaskId.optimizer_step(step),), version=version))
