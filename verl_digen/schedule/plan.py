"""Plan types: a DAG of tasks with worker assignments, and its checks.

A plan is a list of tasks in one global order. Each worker runs the tasks assigned to it
in that order (its *queue*); a task starts once its dependencies are done and it is at the
head of the queue of every worker it occupies (a task on several workers, e.g. the
optimizer step's all-reduce or a weight broadcast, is a gang). A *pulled* task names
candidates instead of a gang: its candidates share one queue of pulled tasks, and whichever
of them is free first when the task reaches its head runs it (sample-granular work taken by
the next free worker); a worker's queue is its own tasks and its pools' pulled tasks, merged
in the global order. Because every queue follows the one global order and dependencies only
point backwards, a plan can never deadlock: the earliest task not yet started is at the head
of every queue it is in.

The semantics are the same for the Ray executor and the simulator; only the clock differs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from enum import Enum
from functools import total_ordering
from typing import Iterable, NamedTuple


class PlanError(ValueError):
    """A plan breaks one of its invariants; the message names the task and the rule."""


class TaskKind(str, Enum):
    GENERATE = "generate"  # sample groups, or a slice of each group's samples (SDE trajectories + images)
    REWARD = "reward"  # score a generate task's images
    TRAIN = "train"  # one trainer micro-batch: recompute log-probs, backward, accumulate
    OPTIMIZER_STEP = "optimizer_step"  # all-reduce gradients over the trainer ranks, step (one per PPO mini-batch)
    SYNC = "sync"  # push trained weights trainer -> rollout (one version)


class WorkerId(NamedTuple):
    """A worker: its pool and its rank there. A named tuple rather than a dataclass: the
    runner and simulator hash and compare worker ids tens of millions of times in a planner
    search, and a tuple's hash and equality run in C (frozen, ordered and hashable alike)."""

    pool: str  # "fused" (colocated), "rollout", "trainer", "reward"
    rank: int

    def __str__(self) -> str:
        return f"{self.pool}{self.rank}"


@total_ordering
@dataclass(frozen=True, eq=True)
class TaskId:
    """A task's identity: its kind and what it serves, as fields (plans look tasks up by it).

    Built with one constructor per kind; :func:`format_task_id` is its one text form, used for
    display, error messages and timeline records. Ids order as their text does: the executor
    sorts a micro-batch's generate tasks, and that order (the order of its inputs) must not
    change with the type.
    """

    kind: TaskKind
    groups: tuple[int, ...] = ()  # GENERATE / REWARD: the task's groups
    step: int | None = None  # TRAIN / OPTIMIZER_STEP: the training step
    version: int | None = None  # SYNC: the weights version it delivers
    micro_batch: int | None = None  # TRAIN: the micro-batch's index in its step
    part: int | None = None  # TRAIN under the time-step split: this rank's part
    rows: int | None = None  # TRAIN cut into row slices (pulled units): the slice's index
    sample_slice: int | None = None  # GENERATE split below the group: the slice's index
    stage: int | None = None  # GENERATE under TSP: the stage index
    mini_batch: int | None = None  # OPTIMIZER_STEP before a step's last PPO mini-batch: its index
    _text: str = field(default="", init=False, repr=False, compare=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hashed once (ids are dict keys of every plan lookup); the text is formatted when asked.
        object.__setattr__(self, "_hash", hash(self._fields()))

    def _fields(self) -> tuple:
        """The fields, in declaration order: the constructor's positional arguments."""
        return (self.kind, self.groups, self.step, self.version, self.micro_batch, self.part, self.rows,
                self.sample_slice, self.stage, self.mini_batch)

    def __reduce__(self):
        # rebuilt from its fields where it is unpickled: a string's hash differs between processes
        return TaskId, self._fields()

    @classmethod
    def generate(cls, groups: tuple[int, ...], *, sample_slice: int | None = None,
                 stage: int | None = None) -> "TaskId":
        return cls(TaskKind.GENERATE, groups=tuple(groups), sample_slice=sample_slice, stage=stage)

    @classmethod
    def reward(cls, groups: tuple[int, ...]) -> "TaskId":
        return cls(TaskKind.REWARD, groups=tuple(groups))

    @classmethod
    def train(cls, step: int, micro_batch: int, *, part: int | None = None, rows: int | None = None) -> "TaskId":
        return cls(TaskKind.TRAIN, step=step, micro_batch=micro_batch, part=part, rows=rows)

    @classmethod
    def optimizer_step(cls, step: int, mini_batch: int | None = None) -> "TaskId":
        """The optimizer step of ``step``'s PPO mini-batch ``mini_batch``; None: its last (or only)
        one, the step that makes the next weights version."""
        return cls(TaskKind.OPTIMIZER_STEP, step=step, mini_batch=mini_batch)

    @classmethod
    def sync(cls, version: int) -> "TaskId":
        return cls(TaskKind.SYNC, version=version)

    def __str__(self) -> str:
        if not self._text:
            object.__setattr__(self, "_text", format_task_id(self))
        return self._text

    def __repr__(self) -> str:
        return f"TaskId({str(self)!r})"

    def __hash__(self) -> int:
        return self._hash

    def __lt__(self, other: "TaskId") -> bool:
        if not isinstance(other, TaskId):
            return NotImplemented
        return str(self) < str(other)


def format_task_id(tid: TaskId) -> str:
    """The one text form of a task id: ``gen:<groups>[:k<slice>][:s<stage>]``,
    ``reward:<groups>``, ``train:<step>:<micro-batch>[:p<part>][:r<row slice>]``, ``opt:<step>[:m<mini-batch>]``,
    ``sync:<version>`` (groups joined by ``-``)."""
    groups = "-".join(str(g) for g in tid.groups)
    if tid.kind == TaskKind.GENERATE:
        text = f"gen:{groups}"
        if tid.sample_slice is not None:
            text += f":k{tid.sample_slice}"
        return text if tid.stage is None else f"{text}:s{tid.stage}"
    if tid.kind == TaskKind.REWARD:
        return f"reward:{groups}"
    if tid.kind == TaskKind.TRAIN:
        return (f"train:{tid.step}:{tid.micro_batch}" + ("" if tid.part is None else f":p{tid.part}")
                + ("" if tid.rows is None else f":r{tid.rows}"))
    if tid.kind == TaskKind.OPTIMIZER_STEP:
        return f"opt:{tid.step}" + ("" if tid.mini_batch is None else f":m{tid.mini_batch}")
    return f"sync:{tid.version}"


@dataclass(frozen=True)
class Task:
    id: TaskId
    kind: TaskKind
    workers: tuple[WorkerId, ...]
    step: int  # the training step whose batch this task serves
    deps: tuple[TaskId, ...] = ()
    groups: tuple[int, ...] = ()  # global group ids: step * groups_per_step + index
    # GENERATE: the weights version the worker must hold (the trajectory's only version).
    # OPTIMIZER_STEP / SYNC: the version it produces / delivers. Versions count rollout batches
    # (training steps): only a step's last mini-batch's optimizer step makes one (step + 1); an
    # earlier one declares ``step`` and leaves its trainers between versions.
    version: int = 0
    images: int = 0
    # GENERATE under TSP: the denoising steps [start, end) this stage takes (None: all), and
    # whether it is the last stage (decodes and completes the groups).
    denoise: tuple[int, int] | None = None
    final: bool = True
    stage: int | None = None  # GENERATE under TSP: the stage index k of denoise (None: all steps)
    # TRAIN under time-step split: (part, parts) -> this task trains trained_steps[part::parts].
    train_part: tuple[int, int] | None = None
    # GENERATE split below the group: samples [start, end) of each of its groups (None: all G).
    # The group's other samples are generated by sibling tasks; its reward task waits for all.
    samples: tuple[int, int] | None = None
    # TRAIN / OPTIMIZER_STEP: the PPO mini-batch of its step it trains / steps (0: the only one).
    mini_batch: int = 0
    # Pulled: ``workers`` are candidates, not a gang; whichever of them is free first when the
    # task reaches the head of their shared queue runs it (:class:`~verl_digen.schedule.runner.PlanRunner`).
    pull: bool = False
    # TRAIN cut into row slices: (k, n) -> this task trains slice k of n of the micro-batch's rows
    # (whole transformer calls dealt round-robin, ``workers/sampling.py: rank_rows``).
    row_part: tuple[int, int] | None = None

    @property
    def pulled(self) -> bool:
        """Whether a free candidate takes it: pulled, with more than one candidate (a pulled task
        of one candidate is that worker's own)."""
        return self.pull and len(self.workers) > 1

    @property
    def worker(self) -> WorkerId:
        """The one worker of a single-worker task (a gang's first); a pulled task has none until
        it runs (the runner binds it then)."""
        if self.pulled:
            raise PlanError(f"{self.id} is pulled by whichever of {[str(w) for w in self.workers]} is free "
                            "first: it has no worker before it runs")
        return self.workers[0]


@dataclass
class Plan:
    """Tasks in one global order; grows step by step while an executor runs it."""

    workers: list[WorkerId]
    tasks: list[Task] = field(default_factory=list)
    max_staleness: int = 0
    start_version: int = 0  # weights version every worker holds when the plan starts (resume)

    def __post_init__(self) -> None:
        self._index: dict[TaskId, Task] = {t.id: t for t in self.tasks}
        self._known = frozenset(self.workers)  # (the worker list is fixed when a plan is made)

    def add(self, task: Task) -> Task:
        if task.id in self._index:
            raise PlanError(f"duplicate task id {task.id}")
        for d in task.deps:
            if d not in self._index:
                raise PlanError(f"task {task.id} depends on {d}, which is not earlier in the plan")
        for w in task.workers:
            if w not in self._known:
                raise PlanError(f"task {task.id} is assigned to unknown worker {w}")
        self.tasks.append(task)
        self._index[task.id] = task
        return task

    def __getitem__(self, task_id: TaskId) -> Task:
        return self._index[task_id]

    def __contains__(self, task_id: TaskId) -> bool:
        return task_id in self._index

    def of_kind(self, kind: TaskKind, step: int | None = None) -> list[Task]:
        return [t for t in self.tasks if t.kind == kind and (step is None or t.step == step)]

    def steps(self) -> list[int]:
        return sorted({t.step for t in self.tasks})

    # ------------------------------------------------------------------ checks

    def check(self, *, complete_steps: Iterable[int] | None = None) -> None:
        """Check every invariant; raise :class:`PlanError` naming the first broken one.

        - dependencies point to earlier tasks (a DAG in queue-consistent order);
        - every group of every complete step is generated, rewarded and trained exactly once,
          and trained after it was rewarded and generated;
        - each step has one optimizer step per PPO mini-batch, each depending on its mini-batch's
          training; a later mini-batch trains after the previous one's step;
        - weights versions: each worker's version, replayed along its queue, equals the
          version every generate task declares (never weights between two mini-batches), and
          a rollout worker trains (GAT) only on the step's own version, in its first mini-batch;
          staleness (training step minus data version, both in rollout batches) stays within
          ``max_staleness``.
        """
        pos = {t.id: i for i, t in enumerate(self.tasks)}
        for t in self.tasks:
            for d in t.deps:
                if d not in pos or pos[d] >= pos[t.id]:
                    raise PlanError(f"task {t.id} depends on {d}, which does not come before it")
        steps = list(complete_steps) if complete_steps is not None else self.steps()
        self._check_groups(steps)
        self._check_versions()

    def _depends_on(self, task_id: TaskId, target_id: TaskId, pos: dict[TaskId, int]) -> bool:
        """Whether ``task_id`` (transitively) waits for ``target_id``.

        Dependencies only point backwards, so the search never follows a task placed before
        the target: it stays within the few steps between them, however long the plan.
        """
        floor = pos[target_id]
        seen: set[TaskId] = set()
        stack = [task_id]
        while stack:
            for d in self._index[stack.pop()].deps:
                if d == target_id:
                    return True
                if d not in seen and pos[d] > floor:
                    seen.add(d)
                    stack.append(d)
        return False

    def _check_groups(self, steps: list[int]) -> None:
        def unit(t: Task) -> tuple:
            # A group is generated once per denoising range and sample slice, trained once per step part.
            return (t.denoise[0] if t.denoise else 0, t.train_part, t.samples, t.row_part)

        for kind in (TaskKind.GENERATE, TaskKind.REWARD, TaskKind.TRAIN):
            counts = Counter((g, unit(t)) for t in self.of_kind(kind) for g in t.groups)
            dup = sorted({g for (g, _), c in counts.items() if c > 1})
            if dup:
                raise PlanError(f"groups {dup[:5]} appear in more than one {kind.value} task")
        self._check_stages()
        self._check_row_parts()
        gen_of: dict[int, list[Task]] = defaultdict(list)  # group -> its final generate tasks
        for t in self.of_kind(TaskKind.GENERATE):
            if t.final:
                for g in t.groups:
                    gen_of[g].append(t)
        self._check_sample_slices(gen_of)
        pos = {t.id: i for i, t in enumerate(self.tasks)}
        rew_of = {g: t for t in self.of_kind(TaskKind.REWARD) for g in t.groups}
        by_step: dict[tuple[TaskKind, int], list[Task]] = defaultdict(list)
        for t in self.tasks:
            by_step[(t.kind, t.step)].append(t)
        for step in steps:
            trains = by_step[(TaskKind.TRAIN, step)]
            self._check_mini_batches(step, trains, by_step[(TaskKind.OPTIMIZER_STEP, step)], pos)
            step_groups = {g for t in by_step[(TaskKind.GENERATE, step)] for g in t.groups}
            trained = {g for t in trains for g in t.groups}
            if step_groups != trained:
                raise PlanError(
                    f"step {step}: generated groups {sorted(step_groups - trained)} are never trained, "
                    f"trained groups {sorted(trained - step_groups)} were never generated"
                )
            for t in trains:
                for g in t.groups:
                    if (
                        g not in rew_of
                        or not self._depends_on(t.id, rew_of[g].id, pos)
                        or not all(self._depends_on(t.id, gen.id, pos) for gen in gen_of[g])
                    ):
                        raise PlanError(f"{t.id} trains group {g} before it is generated and rewarded")
            for g in step_groups:  # the reward scores the whole group: it waits for every slice
                for gen in gen_of[g]:
                    if g in rew_of and gen.id not in rew_of[g].deps:
                        raise PlanError(f"{rew_of[g].id} scores group {g} without waiting for {gen.id}")

    def _check_mini_batches(self, step: int, trains: list[Task], opts: list[Task], pos: dict[TaskId, int]) -> None:
        """PPO mini-batches: one optimizer step per mini-batch ``0..k-1`` (the last one's id
        without a mini-batch index), each waiting for its mini-batch's training; a later
        mini-batch trains on the weights the previous one's step made."""
        k = 1 + max((t.mini_batch for t in trains), default=0)
        by_index = {o.mini_batch: o for o in opts}
        if len(opts) != k or set(by_index) != set(range(k)):
            raise PlanError(f"step {step} has {len(opts)} optimizer steps (mini-batches "
                            f"{sorted(o.mini_batch for o in opts)}), expected one per mini-batch 0..{k - 1}")
        for j, o in by_index.items():
            if o.id != TaskId.optimizer_step(step, None if j == k - 1 else j):
                raise PlanError(f"{o.id} steps mini-batch {j} of {k} of step {step}")
        for t in trains:
            if not self._depends_on(by_index[t.mini_batch].id, t.id, pos):
                raise PlanError(f"optimizer step of step {step} does not wait for {t.id}")
            if t.mini_batch and not self._depends_on(t.id, by_index[t.mini_batch - 1].id, pos):
                raise PlanError(f"{t.id} (mini-batch {t.mini_batch}) does not wait for "
                                f"{by_index[t.mini_batch - 1].id}, the previous mini-batch's step")

    def _check_sample_slices(self, gen_of: dict[int, list[Task]]) -> None:
        """A group split below the group: its final generate tasks' sample slices tile ``[0, end)``."""
        for g, gens in gen_of.items():
            ss = [t.samples for t in gens]
            if len(ss) == 1 and ss[0] is None:
                continue
            if None in ss:
                raise PlanError(f"group {g} is generated whole and in sample slices {sorted(s for s in ss if s)}")
            ordered = sorted(ss)  # type: ignore[type-var]
            if ordered[0][0] != 0 or any(a[1] != b[0] for a, b in zip(ordered, ordered[1:])):
                raise PlanError(f"group {g}: sample slices {ordered} do not tile the group from sample 0")

    def _check_row_parts(self) -> None:
        """A micro-batch cut into row slices: its train tasks are slices ``0..n-1`` of ``n``, of one
        mini-batch, and none of them trains it whole."""
        slices: dict[tuple[int, int], list[Task]] = defaultdict(list)
        for t in self.of_kind(TaskKind.TRAIN):
            slices[(t.step, t.id.micro_batch)].append(t)
        for (step, mb), ts in slices.items():
            parts = [t.row_part for t in ts]
            if all(p is None for p in parts):
                continue
            n = parts[0][1] if parts[0] is not None else None
            if None in parts or sorted(parts) != [(k, n) for k in range(n)] or len({t.mini_batch for t in ts}) != 1:
                raise PlanError(f"step {step} micro-batch {mb}: row slices {sorted(map(str, parts))} do not tile it "
                                "(slices 0..n-1 of one n, one mini-batch)")

    def _check_stages(self) -> None:
        """TSP: each group's stages tile the denoising steps, in order, with one weights version."""
        stages: dict[tuple[int, tuple[int, int] | None], list[Task]] = {}
        for t in self.of_kind(TaskKind.GENERATE):
            if t.denoise is not None:
                for g in t.groups:
                    stages.setdefault((g, t.samples), []).append(t)
        for (g, _samples), ts in stages.items():
            ts.sort(key=lambda t: t.denoise[0])
            if ts[0].denoise[0] != 0 or not ts[-1].final or any(t.final for t in ts[:-1]):
                raise PlanError(f"group {g}: TSP stages do not start at step 0 and end with the final stage")
            for a, b in zip(ts, ts[1:]):
                if a.denoise[1] != b.denoise[0]:
                    raise PlanError(f"group {g}: stage {a.id} ends at {a.denoise[1]} but {b.id} starts at {b.denoise[0]}")
                if a.id not in b.deps:
                    raise PlanError(f"group {g}: stage {b.id} does not wait for {a.id}")
            if len({t.version for t in ts}) != 1:
                raise PlanError(f"group {g}: TSP stages use weights versions {sorted({t.version for t in ts})}")

    def _check_versions(self) -> None:
        # A worker between the mini-batches of a step holds weights of no version: None.
        version: dict[WorkerId, int | None] = {w: self.start_version for w in self.workers}
        for t in self.tasks:
            if t.kind == TaskKind.OPTIMIZER_STEP:
                final = t.id.mini_batch is None
                expected = t.step + 1 if final else t.step
                if t.version != expected:
                    raise PlanError(f"{t.id} declares version {t.version}, expected {expected}")
                for w in t.workers:
                    version[w] = t.version if final else None
            elif t.kind == TaskKind.SYNC:
                for w in t.workers:
                    if w.pool != "trainer":
                        version[w] = t.version
            elif t.kind == TaskKind.TRAIN and t.workers[0].pool == "rollout":
                # GAT: a rollout worker's gradients are added to the trainers', so they must be of
                # the trainers' weights: version ``step``, before the step's first optimizer step.
                # A pulled task: every candidate, since any of them may run it.
                for w in t.workers:
                    held = version[w]
                    if held != t.step or t.mini_batch != 0:
                        raise PlanError(f"{t.id} trains on {w}, which holds version {held}; the trainers' "
                                        f"gradients of mini-batch {t.mini_batch} are of version {t.step} "
                                        "(rollout workers may train only the step's first mini-batch)")
            elif t.kind == TaskKind.GENERATE:
                for w in t.workers:  # one worker, or a pulled task's candidates (any may run it)
                    held = version[w]
                    if held is None:
                        raise PlanError(f"{t.id} generates on {w} between two mini-batches' optimizer steps "
                                        "(weights of no version)")
                    if held != t.version:
                        raise PlanError(f"{t.id} declares weights version {t.version} but {w} holds {held}")
                staleness = t.step - t.version
                if staleness < 0 or staleness > self.max_staleness:
                    raise PlanError(
                        f"{t.id} generates step {t.step} with version {t.version}: staleness {staleness} "
                        f"outside [0, {self.max_staleness}]"
                    )


def group_ids(step: int, groups_per_step: int) -> list[int]:
    return [step * groups_per_step + i for i in range(groups_per_step)]


def chunk(items: list[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(items[i : i + size]) for i in range(0, len(items), size)]


def sample_slices(group_size: int, parts: int) -> list[tuple[int, int] | None]:
    """``parts`` contiguous equal slices ``[start, end)`` of a group's samples (``[None]``: the
    whole group, one task); ``parts`` divides ``group_size``."""
    if parts <= 1:
        return [None]
    if group_size % parts:
        raise ValueError(f"{parts} sample slices do not split a group of {group_size} evenly")
    bounds = [i * group_size // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]
