"""An emulated cluster: the real Ray executor driving N workers that sleep instead of compute.

Each :class:`EmulatedWorker` is a Ray actor with the task methods of
:class:`~verl_digen.workers.worker.DiffusionWorker` (:class:`~verl_digen.workers.messages.WorkerTasks`:
``generate``, ``compute_reward``, ``train_micro_batch``, ``optimizer_step``, ``sync_join``,
``sync_recv``, plus the set-up calls the training loop makes), taking the same requests. A call
sleeps for the cost model's duration of the task, times ``time_scale``, and returns the same
typed results with the smallest data the executor and the loop consume: reward vectors, zero
train and optimizer metrics, sync statistics. Weights versions are kept
and checked as the real worker does, and each worker tracks its generate/train mode, so
switches cost what the simulator charges.

So the orchestration code itself (plan building, dispatch, ``ray.wait``, object refs, the
driver's advantage computation, the loop's bookkeeping) runs at 16-32 devices on a laptop, and
its overhead is measured against the simulator on the same plan:

- :func:`emulated_worker_groups` is a worker-group factory for
  :class:`~verl_digen.trainer.loop.DigenTrainer` (``digen.emulate.model=...`` selects it), so
  the training loop runs unchanged (hydra config, planner, executor, metrics, timeline, Gantt);
- ``python -m verl_digen.emulate`` runs a given plan, or the loop, on emulated workers and
  compares each step with the simulator.

Nothing here imports torch at module level: actor processes stay small (tensors are built
when the driver unpickles a reward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from verl_digen.schedule.plan import Task, TaskKind, WorkerId
from verl_digen.sim.cost_model import Cluster, CostModel, PoolPlacement
from verl_digen.workers.messages import (
    GenerateRequest,
    Gradients,
    check_assisted_gradients,
    OptimizerRequest,
    OptimizerResult,
    RewardResult,
    SyncResult,
    TrainRequest,
    TrainResult,
)


def _as_tensor(values: list, dtype: str) -> Any:
    import torch

    return torch.tensor(values, dtype=getattr(torch, dtype))


class TensorData:
    """A list that becomes a ``torch.Tensor`` when unpickled (on the driver)."""

    def __init__(self, values: list, dtype: str) -> None:
        self.values = values
        self.dtype = dtype

    def __reduce__(self) -> tuple:
        return (_as_tensor, (self.values, self.dtype))


@dataclass(frozen=True)
class EmulatedTrajectories:
    """What an emulated generate returns: which groups, how many rows, which weights version."""

    group_ids: tuple[int, ...]
    group_size: int
    policy_version: int
    samples: tuple[int, int] | None = None  # the slice of each group's samples (None: all)


def emulated_reward(group: int, index: int) -> float:
    """A deterministic reward in [0, 1) per sample (non-constant within a group)."""
    x = (group * 2654435761 + index * 40503 + 12345) % 1_000_003
    return x / 1_000_003


class EmulatedWorker:
    """Sleeps for the cost model's seconds; returns what the executor expects. Provides
    :class:`~verl_digen.workers.messages.WorkerTasks` with the real worker's signatures."""

    def __init__(
        self, worker: WorkerId, costs: Any, cluster: Cluster, *, group_size: int, time_scale: float = 1.0
    ) -> None:
        self.worker = worker
        self.costs = costs
        self.cluster = cluster
        self.group_size = group_size
        self.time_scale = time_scale
        self.mode = costs.initial_mode(worker)
        self.policy_version = 0
        # (kind, groups, modelled seconds) of every task part this worker ran, in order: what it
        # charged, for checks against the simulator (python -m verl_digen.emulate, tests)
        self.charged: list[tuple[str, tuple[int, ...], float]] = []

    def _work(self, kind: TaskKind, *, groups: tuple[int, ...] = (), step: int = 0, version: int = 0,
              ranks: int = 1, **fields: Any) -> float:
        """Sleep for the cost model's seconds of this worker's part of a task; ``ranks``: the
        workers of a gang task (an FSDP micro-batch: ranks 0..ranks-1 of this worker's pool),
        which the cost model charges each member for, as the simulator does."""
        samples = fields.get("samples")
        per_group = samples[1] - samples[0] if samples else self.group_size
        gang = (self.worker,) if ranks == 1 else tuple(WorkerId(self.worker.pool, r) for r in range(ranks))
        task = Task(
            id="emulated", kind=kind, workers=gang, step=step, groups=groups, version=version,
            images=len(groups) * per_group, **fields,
        )
        seconds = self.costs.task_seconds(task, self.worker, self.cluster, switch_from=self.mode)
        self.charged.append((kind.value, tuple(groups), seconds))
        after = self.costs.mode_of(task, self.worker)
        if after is not None:
            self.mode = after
        time.sleep(seconds * self.time_scale)
        return seconds

    # ------------------------------------------------------------------ set-up (the loop's calls)

    def open_rendezvous(self) -> int | None:
        return None  # emulated trainers form no process group

    def init_model(self, rendezvous_port: int | None = None) -> dict[str, Any]:
        self.warm_up()
        return {"role": self.worker.pool, "rank": self.worker.rank, "emulated": True}

    def warm_up(self) -> str:
        """Trainers import torch now: the driver sends them advantages as tensors (a real
        worker has torch loaded from the start; the first train call should not pay for it)."""
        if self.worker.pool in ("trainer", "fused"):
            import torch  # noqa: F401

        return str(self.worker)

    def sync_master_endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def sync_open(self, *args: Any, **kwargs: Any) -> None:
        return None

    def weights_digest(self) -> str:
        return "emulated"

    def refresh_full_state(self) -> int:
        return self.policy_version  # an emulated trainer holds no weights to gather

    def ping(self) -> str:
        return str(self.worker)

    def charges(self) -> list[tuple[str, tuple[int, ...], float]]:
        """What this worker charged so far (see ``charged``)."""
        return list(self.charged)

    def get_policy_version(self) -> int:
        return self.policy_version

    # ------------------------------------------------------------------ tasks

    def generate(
        self, request: GenerateRequest, previous: EmulatedTrajectories | None = None
    ) -> EmulatedTrajectories:
        """Whole groups, or one TSP stage (``request.denoise``) continuing ``previous``."""
        if request.version != self.policy_version:
            raise RuntimeError(
                f"{self.worker} holds weights version {self.policy_version} but the plan generates groups "
                f"{list(request.group_ids)} with version {request.version}"
            )
        groups = request.group_ids
        fields: dict[str, Any] = {}
        denoise = request.denoise
        if denoise is not None:
            total = getattr(getattr(self.costs, "workload", None), "num_steps", denoise[1])
            fields = {"denoise": denoise, "final": denoise[1] >= total}
        if request.samples is not None:
            fields["samples"] = request.samples
        self._work(TaskKind.GENERATE, groups=groups, step=request.step, version=request.version, **fields)
        if request.chunk_rows:  # one object per chunk of one group's samples, as the real worker returns
            s0, s1 = request.samples or (0, self.group_size)
            m = request.chunk_rows
            return tuple(EmulatedTrajectories((g,), self.group_size, self.policy_version, (a, a + m))
                         for g in groups for a in range(s0, s1, m))
        return EmulatedTrajectories(groups, self.group_size, self.policy_version, request.samples)

    def profile_step_costs(self, prompt: str, repeats: int = 2) -> dict[str, Any]:
        """What TSP's stage balancing asks a rollout worker (modelled, not measured: ``prompt`` and
        ``repeats`` are the real worker's and change nothing here)."""
        if hasattr(self.costs, "step_profile"):
            return self.costs.step_profile(self.costs.device(self.cluster.device_of(self.worker)), self.group_size)
        steps = getattr(getattr(self.costs, "workload", None), "num_steps", 8)
        return {"step_s": [1.0] * steps, "head_s": 0.0, "tail_s": 0.0}

    def compute_reward(self, *slices: EmulatedTrajectories) -> RewardResult:
        """Whole groups: one generate output, or a group's sample slices. The vectors become
        tensors when the driver unpickles them (:class:`TensorData`)."""
        groups = tuple(dict.fromkeys(g for s in slices for g in s.group_ids))
        self._work(TaskKind.REWARD, groups=groups)
        rows = [(g, i) for g in groups for i in range(self.group_size)]
        # No rollout_rows: there are no images to dump (digen.rollout_data_dir is refused with emulation).
        return RewardResult(
            group_id=TensorData([g for g, _ in rows], "int64"),
            rewards=TensorData([emulated_reward(g, i) for g, i in rows], "float32"),
            policy_version=TensorData([slices[0].policy_version] * len(rows), "int64"),
        )

    def train_micro_batch(self, request: TrainRequest, *trajectories: EmulatedTrajectories) -> TrainResult | tuple:
        groups = request.groups
        versions = [t.policy_version for t in trajectories if set(t.group_ids) & set(groups)]
        if not versions:
            raise KeyError(f"groups {groups} are in none of the trajectories passed to {self.worker}")
        part = request.train_part
        # an FSDP gang rank's or a row slice's share of the rows (charged as the simulator charges it)
        ranks = request.row_part[1] if request.row_part is not None else 1
        seconds = self._work(TaskKind.TRAIN, groups=groups, ranks=ranks, **({"train_part": part} if part else {}))
        result = TrainResult(
            metrics={"actor/loss": 0.0, "actor/emulated_s": seconds},
            staleness_max=float(self.policy_version - min(versions)),
            staleness_min=float(self.policy_version - max(versions)),
        )
        if request.return_gradients:  # GAT: an empty gradient record, checked by trainer 0 as the real one is
            return result, Gradients(tensors={}, version=self.policy_version, groups=tuple(groups))
        return result

    def optimizer_step(self, request: OptimizerRequest = OptimizerRequest(), *gradients: Gradients) -> OptimizerResult:
        """The cost model's seconds for this mini-batch's step; the last one makes the version.
        GAT's ``gradients`` must be of the weights this worker holds, as the real worker checks."""
        check_assisted_gradients(request, gradients, self.policy_version, str(self.worker))
        self._work(TaskKind.OPTIMIZER_STEP, mini_batch=request.mini_batch)
        if not request.final:
            return OptimizerResult(metrics={"actor/grad_norm": 0.0, "actor/lr": 0.0, "actor/skipped_nonfinite": 0.0},
                                   policy_version=self.policy_version)
        self.policy_version += 1
        return OptimizerResult(
            metrics={"actor/grad_norm": 0.0, "actor/lr": 0.0, "actor/skipped_nonfinite": 0.0},
            policy_version=self.policy_version,
        )

    def _sync_stats(self, version: int, seconds: float) -> SyncResult:
        nbytes = int(getattr(self.costs, "sync_bytes", 0))
        return SyncResult(version=version, nbytes=nbytes, seconds=seconds * self.time_scale, num_tensors=0)

    def sync_join(self, timeout_s: float | None = None) -> None:
        """The real sender's background send has nothing to wait for here: the receivers'
        sync task carries the transfer's seconds, as in the plan."""
        return None

    def sync_recv(self) -> SyncResult:
        seconds = self._work(TaskKind.SYNC)
        self.policy_version += 1  # syncs deliver versions in order
        return self._sync_stats(self.policy_version, seconds)


# ---------------------------------------------------------------------------- worker groups


class _EmulatedGroup:
    """Stands in for a RayWorkerGroup: the loop reads ``.workers`` (and the placement groups of
    ``.resource_pool``, none here)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.resource_pool = None


def cluster_for_layout(layout: Any, device: str) -> Cluster:
    """The :class:`Cluster` of a loop's ``PoolLayout`` (each pool's devices on every node)."""
    return Cluster({name: PoolPlacement.spread(on_nodes, device) for name, (on_nodes, _accel) in layout.pools.items()})


def emulated_worker_groups(
    costs: Any, *, device: str, time_scale: float, group_size: int
) -> Callable[[Any], tuple[dict[str, Any], dict[WorkerId, Any]]]:
    """A worker-group factory for the training loop: for each pool of a ``PoolLayout``, emulated
    actors (no CPU reserved: they only sleep) in place of ``DiffusionWorker`` groups."""

    def build(layout: Any) -> tuple[dict[str, Any], dict[WorkerId, Any]]:
        import ray

        cluster = cluster_for_layout(layout, device)
        # the training pool's memory decisions made once, here: each worker gets them with its
        # copy of the cost model (CostModel.train_group finds an equal cluster's) instead of
        # tracing the real model on the meta device itself, all at once on the driver's CPUs
        costs.train_group(cluster)
        remote = ray.remote(num_cpus=0)(EmulatedWorker)
        groups, actors = {}, {}
        for pool, (process_on_nodes, _accel) in layout.pools.items():
            ranks = [WorkerId(pool, r) for r in range(sum(process_on_nodes))]
            handles = [remote.remote(w, costs, cluster, group_size=group_size, time_scale=time_scale) for w in ranks]
            groups[pool] = _EmulatedGroup(handles)
            actors.update(zip(ranks, handles))
        return groups, actors

    return build


def emulation_costs(model: str, device: str) -> Any:
    """The cost model an emulated run sleeps by (``digen.emulate.model`` on ``device_type``)."""
    from verl_digen.sim.cost_model import load_catalog

    return CostModel.from_catalog(load_catalog(), model, devices=[device])
