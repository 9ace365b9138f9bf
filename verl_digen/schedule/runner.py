"""The execution semantics of a plan, shared by the Ray executor and the simulator.

:class:`PlanRunner` is a list scheduler over per-worker queues: a task is launched when all
its dependencies are done and it is at the head of the queue of every worker it occupies
(and those workers are idle). Subclasses supply the clock: :meth:`_launch` starts a task,
:meth:`_wait_one` returns the next one to finish. Every interval is recorded in a
:class:`~verl_digen.schedule.timeline.Timeline`.
"""

from __future__ import annotations

import abc
from typing import Any

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
        self._check: dict[TaskId, Task] = {}

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
            for w in t.workers:
                self._queues[w].append(t)
            for d in t.deps:
                self._dependents.setdefault(d, []).append(t)
            self._check[t.id] = t
            self._seen += 1

    def _head_task(self, w: WorkerId) -> Task | None:
        q = self._queues[w]
        i = self._head[w]
        return q[i] if i < len(q) else None

    def _ready(self, t: Task) -> bool:
        """At the head of every queue it occupies, those workers idle, its dependencies done."""
        return (t.id not in self.running and t.id not in self.done
                and all(x not in self._busy and self._head_task(x) is t for x in t.workers)
                and all(d in self.done for d in t.deps))

    def launchable(self) -> list[Task]:
        """The tasks that can start now, in the order of the first of their workers in
        ``plan.workers`` (the order a scan of every queue's head finds them in)."""
        self._sync_queues()
        for tid in [tid for tid, t in self._check.items() if not self._ready(t)]:
            del self._check[tid]  # an event (above) looks at it again when it may have changed
        return sorted(self._check.values(), key=lambda t: min(self._order[w] for w in t.workers))

    def _finished(self, task: Task) -> None:
        """Mark ``task`` done; what it unblocks is looked at next."""
        for w in task.workers:
            self._busy.discard(w)
            self._head[w] += 1
        self.done.add(task.id)
        self.finished_order.append(task.id)
        for t in [self._head_task(w) for w in task.workers] + self._dependents.pop(task.id, []):
            if t is not None:
                self._check[t.id] = t

    def run_until(self, task_ids: list[TaskId] | None = None) -> None:
        """Run until every task in ``task_ids`` is done (all planned tasks when None)."""
        waiting = None if task_ids is None else {t for t in task_ids if t not in self.done}
        while True:
            if waiting is None and len(self.done) == len(self.plan.tasks):
                return  # every task of the plan (which may grow while it runs)
            if waiting is not None and not waiting:
                return
            for t in self.launchable():
                self.running[t.id] = self.now()
                self._busy.update(t.workers)
                del self._check[t.id]
                self._launch(t)
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
                    workers=[str(w) for w in task.workers],
                    start=start,
                    end=end,
                    step=task.step,
                    version=task.version,
                    groups=list(task.groups),
                    extra={**self._record_extra(task, result),
                           **({"samples": list(task.samples)} if task.samples is not None else {})},
                    stage=task.stage,
                )
            )
            self._on_finish(task, result, start, end)
