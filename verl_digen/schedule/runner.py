"""The execution semantics of a plan, shared by the Ray executor and the simulator.

:class:`PlanRunner` is a list scheduler over per-worker queues: a task is launched when all
its dependencies are done and it is at the head of the queue of every worker it occupies
(and those workers are idle); a pulled task, when it is at the head of its candidates' shared
queue and one of them is idle with nothing earlier to run, on the first such candidate in
``plan.workers`` order. Subclasses supply the clock: :meth:`_launch` starts a task (a pulled
one bound to the worker that took it),
:meth:`_wait_one` returns the next one to finish. Every interval is recorded in a
:class:`~verl_digen.schedule.timeline.Timeline`.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from typing import Any, Iterator

from verl_digen.schedule.plan import Plan, PlanError, Task, TaskId, WorkerId
from verl_digen.schedule.timeline import TaskRecord, Timeline


class PlanRunner(abc.ABC):
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.timeline = Timeline(workers=[str(w) for w in plan.workers])
        self.done: set[TaskId] = set()
        self.finished_order: list[TaskId] = []
        self.running: dict[TaskId, float] = {}  # task id -> start time
        self._queues: dict[WorkerId, list[Task]] = {w: [] for w in plan.workers}
        self._head: dict[WorkerId, int] = {w: 0 for w in plan.workers}
        self._busy: set[WorkerId] = set()
        self._seen = 0  # plan.tasks already distributed to queues
        # Only an event can make a task launchable: it is added to the plan, reaches the head of a
        # queue, or its last dependency finishes. Those tasks are looked at, not every queue's head
        # after every event (the simulator of a 32-device plan handles ~200k events per search).
        self._order = {w: i for i, w in enumerate(plan.workers)}
        self._dependents: dict[TaskId, list[Task]] = {}
        # Dependencies not done yet, per task: readiness is a lookup, not a scan of the deps (a
        # step's training waits on every reward task of it; such tasks are looked at often).
        self._missing: dict[TaskId, int] = {}
        self._check: dict[TaskId, Task] = {}
        # Pulled tasks: one shared queue per candidate set, taken from its head at launch.
        self._position: dict[TaskId, int] = {}
        self._pools: dict[tuple[WorkerId, ...], list[Task]] = {}
        self._pool_head: dict[tuple[WorkerId, ...], int] = {}
        self._pools_of: dict[WorkerId, list[tuple[WorkerId, ...]]] = {w: [] for w in plan.workers}
        self._taken: set[TaskId] = set()  # pulled tasks started
        self.bound: dict[TaskId, tuple[WorkerId, ...]] = {}  # running or done task -> the workers it ran on

    # ------------------------------------------------------------------ clock

    @abc.abstractmethod
    def now(self) -> float: ...

    @abc.abstractmethod
    def _launch(self, task: Task) -> None:
        """Start ``task`` on its workers."""

    @abc.abstractmethod
    def _wait_one(self) -> tuple[TaskId, Any]:
        """Block until one running task finishes; return its id and its result."""

    def _on_finish(self, task: Task, result: Any, start: float, end: float) -> None:
        """Hook for subclasses (collect results)."""

    def _record_extra(self, task: Task, result: Any) -> dict[str, Any]:
        return {}

    def step_metrics(self, step: int) -> dict[str, Any]:
        """What ``step`` produced beyond timing (rewards, losses); none in virtual time."""
        return {}

    # ------------------------------------------------------------------ scheduling

    def _sync_queues(self) -> None:
        tasks = self.plan.tasks
        while self._seen < len(tasks):
            t = tasks[self._seen]
            self._position[t.id] = self._seen
            if t.pulled:
                if t.workers not in self._pools:
                    self._pools[t.workers], self._pool_head[t.workers] = [], 0
                    for w in t.workers:
                        self._pools_of[w].append(t.workers)
                self._pools[t.workers].append(t)
            else:
                for w in t.workers:
                    self._queues[w].append(t)
            missing = 0
            for d in t.deps:
                if d not in self.done:
                    self._dependents.setdefault(d, []).append(t)
                    missing += 1
            self._missing[t.id] = missing
            self._check[t.id] = t
            self._seen += 1

    def _head_task(self, w: WorkerId) -> Task | None:
        """What ``w`` runs next, if it can: the first pulled task of its candidate queues whose
        dependencies are done and that comes before its own queue's head; its own head only
        when no pulled task before it is still unstarted (a gang, e.g. a weight sync, starts
        once every task planned before it has: so a pulled task always finds the weights
        version it was planned for). None: it waits."""
        q = self._queues[w]
        i = self._head[w]
        own = q[i] if i < len(q) else None
        if not self._pools_of[w]:
            return own  # a worker no pulled task names (every worker of a plan without them)
        limit = self._position[own.id] if own is not None else len(self.plan.tasks)
        pulled, blocked = None, False
        for pool in self._pools_of[w]:
            for t in self._unstarted(pool):
                pos = self._position[t.id]
                if pos >= limit:
                    break
                if not self._missing[t.id]:
                    pulled, limit = t, pos  # the earliest ready one over all pools
                    break
                blocked = True
        if pulled is not None:
            return pulled
        return None if blocked else own

    def _unstarted(self, pool: tuple[WorkerId, ...]) -> Iterator[Task]:
        """The pool's pulled tasks not started yet, in plan order (the started ones at its front
        are dropped for good)."""
        q, taken = self._pools[pool], self._taken
        while self._pool_head[pool] < len(q) and q[self._pool_head[pool]].id in taken:
            self._pool_head[pool] += 1
        return (t for t in itertools.islice(q, self._pool_head[pool], None) if t.id not in taken)

    def _takers(self, t: Task) -> list[WorkerId]:
        """The idle workers that would run ``t`` now: every worker of a gang, or one candidate of
        a pulled task (the first in ``plan.workers`` order); empty if it cannot start."""
        busy, head = self._busy, self._head_task
        if t.pulled:
            return next(([x] for x in t.workers if x not in busy and head(x) is t), [])
        for x in t.workers:  # a gang: every worker, or none (stop at the first that is not free)
            if x in busy or head(x) is not t:
                return []
        return list(t.workers)

    def _ready(self, t: Task) -> bool:
        """At the head of every queue it occupies (a pulled task: of its shared queue, with a
        candidate idle), those workers idle, its dependencies done."""
        return (not self._missing[t.id] and t.id not in self.running and t.id not in self.done
                and bool(self._takers(t)))

    def launchable(self) -> list[Task]:
        """The tasks that can start now, in the order of the first of their workers in
        ``plan.workers`` (the order a scan of every queue's head finds them in)."""
        self._sync_queues()
        for tid in [tid for tid, t in self._check.items() if not self._ready(t)]:
            del self._check[tid]  # an event (above) looks at it again when it may have changed
        return sorted(self._check.values(), key=lambda t: min(self._order[w] for w in t.workers))

    def _look_at_heads(self, workers: tuple[WorkerId, ...]) -> None:
        for w in workers:
            t = self._head_task(w)
            if t is not None:
                self._check[t.id] = t

    def _start_task(self, t: Task) -> Task:
        """Mark ``t`` running on the workers that take it; a pulled task leaves its shared queue
        now (the next one may start on another candidate at once) and is returned bound to its
        worker (a single-worker task), which is what the subclass launches and records."""
        workers = tuple(self._takers(t))
        self.running[t.id] = self.now()
        self._busy.update(workers)
        self.bound[t.id] = workers
        del self._check[t.id]
        if not t.pulled:
            return t
        self._taken.add(t.id)
        self._look_at_heads(t.workers)  # the next pulled task, or a gang behind this one
        return self.bound_task(t.id)

    def bound_task(self, tid: TaskId) -> Task:
        """Task ``tid`` as it runs (or ran): a pulled task on the worker that took it."""
        task = self.plan[tid]
        if not task.pulled:
            return task
        return dataclasses.replace(task, workers=self.bound[tid], pull=False)

    def _finished(self, task: Task) -> None:
        """Mark ``task`` done; what it unblocks is looked at next."""
        workers = self.bound[task.id]
        for w in workers:
            self._busy.discard(w)
        if not task.pulled:
            for w in workers:
                self._head[w] += 1
        self.done.add(task.id)
        self.finished_order.append(task.id)
        self._look_at_heads(workers)
        for t in self._dependents.pop(task.id, []):
            self._missing[t.id] -= 1
            self._check[t.id] = t
            if t.pulled:  # ready now: an idle candidate may take it before its own head
                self._look_at_heads(t.workers)

    def run_until(self, task_ids: list[TaskId] | None = None) -> None:
        """Run until every task in ``task_ids`` is done (all planned tasks when None)."""
        waiting = None if task_ids is None else {t for t in task_ids if t not in self.done}
        while True:
            if waiting is None and len(self.done) == len(self.plan.tasks):
                return  # every task of the plan (which may grow while it runs)
            if waiting is not None and not waiting:
                return
            ready = self.launchable()
            while ready:  # starting a pulled task can make the next one of its queue launchable
                for t in ready:
                    if self._ready(t):  # (an earlier one of this round may have taken its worker)
                        self._launch(self._start_task(t))
                ready = self.launchable()
            if not self.running:
                targets = [t.id for t in self.plan.tasks] if task_ids is None else task_ids
                pending = [t for t in targets if t not in self.done]
                raise PlanError(f"plan cannot make progress; waiting on {pending[:5]} (not launchable)")
            tid, result = self._wait_one()
            task = self.plan[tid]
            start = self.running.pop(tid)
            end = self.now()
            self._finished(task)
            if waiting is not None:
                waiting.discard(tid)
            self.timeline.add(
                TaskRecord(
                    task=str(tid),  # the id's text form: timelines are written as JSON
                    kind=task.kind.value,
                    workers=[str(w) for w in self.bound[tid]],
                    start=start,
                    end=end,
                    step=task.step,
                    version=task.version,
                    groups=list(task.groups),
                    extra={**self._record_extra(task, result),
                           **({"samples": list(task.samples)} if task.samples is not None else {}),
                           **({"rows": list(task.row_part)} if task.row_part is not None else {})},
                    stage=task.stage,
                )
            )
            self._on_finish(task, result, start, end)
