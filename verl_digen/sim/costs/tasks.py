"""The task interface the simulator calls: :meth:`TaskCosts.task_seconds` (seconds a worker is busy
with a task, a mode switch included), the mode a task needs, a machine's contention, and the
task fields strategies set (TSP's trained-step split, a worker's rollout batch and share).

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

import math

from verl_digen.schedule.plan import Task, TaskKind, WorkerId
from verl_digen.sim.costs.cluster import Cluster


MODE_GENERATE = "generate"
MODE_TRAIN = "train"


class TaskCosts:
    """Seconds per task, and the modes and shares of workers."""

    @staticmethod
    def mode_of(task: Task, worker: WorkerId) -> str | None:
        """The mode a worker must be in to run ``task`` (None: either). A rollout worker trains
        (GAT) in the mode it generates in: it holds the weights and switches nothing."""
        if task.kind == TaskKind.GENERATE:
            return MODE_GENERATE
        if task.kind == TaskKind.TRAIN and worker.pool == "rollout":
            return None
        if task.kind in (TaskKind.TRAIN, TaskKind.OPTIMIZER_STEP):
            return MODE_TRAIN
        if task.kind == TaskKind.SYNC and worker.pool == "trainer":
            return MODE_TRAIN
        return None

    @staticmethod
    def initial_mode(worker: WorkerId) -> str:
        return MODE_TRAIN if worker.pool == "trainer" else MODE_GENERATE

    def contention_factor(self, worker: WorkerId, cluster: Cluster, busy_others: int) -> float:
        """Slow-down of a task that starts while ``busy_others`` other devices of the same
        machine are busy (only devices with ``host_contention``, i.e. CPU slots)."""
        dev = self.device(cluster.device_of(worker))
        return 1.0 + dev.host_contention * busy_others

    def trained_steps_of(self, task: Task) -> int:
        """Trained time steps a TRAIN task computes (its share under a time-step split)."""
        k = self.workload.trained_steps
        part = getattr(task, "train_part", None)
        if part is None:
            return k
        p, parts = part
        return len(range(p, k, parts))

    def rollout_batch(self, cluster: Cluster, pool: str) -> int | None:
        """Samples per rollout forward for a worker of ``pool``: an engine that batches all of a
        worker's requests (``system.rollout_batch``) forms batches up to that size from the
        worker's share of the step; otherwise a task's images form one batch."""
        cap = self.system.rollout_batch
        if not cap:  # this runtime: a task's samples in transformer calls of call_rows (workers/sampling.py)
            return self.workload.call_rows or None
        share = math.ceil(self.workload.images_per_step / max(1, cluster.placement(pool).size))
        return min(cap, share)

    def images_per_worker(self, cluster: Cluster, pool: str) -> int:
        """A worker of ``pool``'s share of the step's images."""
        return math.ceil(self.workload.images_per_step / max(1, cluster.placement(pool).size))

    def task_seconds(
        self, task: Task, worker: WorkerId, cluster: Cluster, *, switch_from: str | None = None
    ) -> float:
        """Seconds ``worker`` is busy with ``task``; a mode switch is added when ``switch_from``
        is the worker's current mode and the task needs the other one."""
        dev = self.device(cluster.device_of(worker))
        images = task.images or len(task.groups) * self.workload.group_size
        if task.kind == TaskKind.GENERATE:
            t = self.generate_seconds(
                images, dev, getattr(task, "denoise", None), final=getattr(task, "final", True),
                batch=self.rollout_batch(cluster, worker.pool),
                gather_s=self.generation_gather_seconds(dev, cluster, worker.pool),
            )
        elif task.kind == TaskKind.REWARD:
            t = self.reward_seconds(images, dev, residency=self.reward_residency(worker),
                                    per_worker=self.images_per_worker(cluster, worker.pool))
        elif task.kind == TaskKind.TRAIN and worker.pool == "rollout":  # GAT
            t = self.gat_train_seconds(images, dev, cluster, self.trained_steps_of(task))
        elif task.kind == TaskKind.TRAIN:
            # a gang (lockstep FSDP) micro-batch: every rank takes its share of the samples
            share = math.ceil(images / len(task.workers))
            t = self.train_seconds(share, dev, self.train_group(cluster), self.trained_steps_of(task), pool=worker.pool)
        elif task.kind == TaskKind.OPTIMIZER_STEP:
            mini = getattr(task, "mini_batch", 0)
            t = self.optimizer_task_seconds(dev, self.train_group(cluster), mini)
            if mini == self.workload.optimizer_tasks - 1:  # the new version's host copy (sync)
                t += self.snapshot_seconds(dev, cluster)
        elif task.kind == TaskKind.SYNC:
            t = self.sync_seconds(cluster)
        else:  # pragma: no cover - TaskKind is closed
            raise ValueError(task.kind)
        to = self.mode_of(task, worker)
        if switch_from is not None and to is not None and to != switch_from:
            t += self.switch_seconds(to, dev, self.train_group(cluster))
        return t + self.system.task_overhead_s
