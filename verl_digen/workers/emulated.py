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

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from verl_digen.schedule.plan import Task, TaskKind, WorkerId
from verl_digen.sim.cost_model import Cluster, PoolPlacement
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
        # The weight channel as the real sender and receivers wait on it (sync_open): None in a
        # plan run without one (run_emulated_plan), where the sync task alone carries the transfer.
        self._board: Any = None
        self._receivers = 0
        self._send_thread: threading.Thread | None = None
        self._send_outcome: float | BaseException | None = None
        self.deadlines: Any = None  # set_deadlines: the run's, scaled as this worker's sleeps
        # Real seconds each blocking call waited (send: for the receivers; join: for the send),
        # reported with the next optimizer step's metrics for the rehearsal's checks.
        self._waited = {"send_s": 0.0, "join_s": 0.0}

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

    def set_deadlines(self, deadlines: Any) -> None:
        self.deadlines = deadlines

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
        """The emulated channel: a :class:`SyncBoard` actor of this sender's, named in place of an address."""
        import ray

        name = f"digen-emulated-sync-{uuid.uuid4().hex}"
        self._board = ray.remote(num_cpus=0)(SyncBoard).options(name=name).remote()
        ray.get(self._board.ready.remote())
        return name, 0

    def sync_open(self, rank: int, world_size: int, master_addr: str, *args: Any, **kwargs: Any) -> None:
        """Join the emulated channel named ``master_addr`` (the sender made it)."""
        import ray

        if rank > 0:
            self._board = ray.get_actor(master_addr)
        self._receivers = world_size - 1

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
        metrics = {"actor/grad_norm": 0.0, "actor/lr": 0.0, "actor/skipped_nonfinite": 0.0}
        if not request.final:
            return OptimizerResult(metrics=metrics, policy_version=self.policy_version)
        self.policy_version += 1
        if self._board is not None and self._receivers:
            # the real sender's order: join the last send (its snapshot is reused), send the new one
            self.sync_join(self.deadlines.join_s)
            self._send_in_background(self.policy_version)
            metrics.update({f"sync/waited_{k}": v for k, v in self._waited.items()})
        return OptimizerResult(metrics=metrics, policy_version=self.policy_version)

    def _send_in_background(self, version: int) -> None:
        """The real sender's side thread (``WeightSyncMixin.sync_send_in_background``): wait for
        every receiver within the send's deadline, then the transfer's seconds."""
        import ray

        board, deadline = self._board, self.deadlines.send_s
        transfer = self.costs.sync_seconds(self.cluster) * self.time_scale if hasattr(self.costs, "sync_seconds") else 0.0

        def send() -> None:
            try:
                t0 = time.monotonic()
                if not ray.get(board.wait_arrived.remote(version, self._receivers, deadline)):
                    raise TimeoutError(f"weight sync: the rollout workers did not reach version {version} "
                                       f"within {deadline:g} s")
                self._waited["send_s"] = max(self._waited["send_s"], time.monotonic() - t0)
                ray.get(board.sent.remote(version))  # the broadcast begins: sender and receivers take its seconds
                time.sleep(transfer)
                self._send_outcome = time.monotonic() - t0
            except BaseException as e:  # noqa: BLE001 - handed to the next sync_join, which raises it
                self._send_outcome = e

        self._send_outcome = None
        self._send_thread = threading.Thread(target=send, name=f"digen-weight-sync-v{version}", daemon=True)
        self._send_thread.start()

    def _sync_stats(self, version: int, seconds: float) -> SyncResult:
        nbytes = int(getattr(self.costs, "sync_bytes", 0))
        return SyncResult(version=version, nbytes=nbytes, seconds=seconds * self.time_scale, num_tensors=0)

    def sync_join(self, timeout_s: float | None = None) -> None:
        """Wait for the send in flight, as the real sender does: raise what it raised, or a
        ``TimeoutError`` when it outlasts ``timeout_s``. Without a channel (a plan run) there is
        none: the receivers' sync task carries the transfer's seconds, as in the plan."""
        thread, self._send_thread = self._send_thread, None
        if thread is None:
            return None
        t0 = time.monotonic()
        thread.join(timeout_s)
        self._waited["join_s"] = max(self._waited["join_s"], time.monotonic() - t0)
        if thread.is_alive():
            self._send_thread = thread
            raise TimeoutError(f"weight sync: {thread.name} still sending after {timeout_s:g} s")
        outcome, self._send_outcome = self._send_outcome, None
        if isinstance(outcome, BaseException):
            raise RuntimeError(f"weight sync: {thread.name} failed on the sender: "
                               f"{type(outcome).__name__}: {outcome}") from outcome
        return None

    def sync_recv(self) -> SyncResult:
        """With a channel, first what a real receiver waits for: arrive, then the sender's
        broadcast within the channel's collective deadline."""
        version = self.policy_version + 1  # syncs deliver versions in order
        if self._board is not None:
            import ray

            ray.get(self._board.arrive.remote(version))
            if not ray.get(self._board.wait_sent.remote(version, self.deadlines.channel_s)):
                raise TimeoutError(f"weight sync: {self.worker} waited {self.deadlines.channel_s:g} s in the "
                                   f"broadcast of version {version}")
        seconds = self._work(TaskKind.SYNC)
        self.policy_version = version
        return self._sync_stats(self.policy_version, seconds)


class SyncBoard:
    """The emulated weight channel's meeting point (an async Ray actor of the sender's): receivers
    say they arrived at a version, the sender waits for all of them, then says it sent."""

    def __init__(self) -> None:
        import asyncio

        self._arrived: dict[int, int] = {}
        self._sent: set[int] = set()
        self._changed = asyncio.Condition()

    async def ready(self) -> bool:
        return True

    async def arrive(self, version: int) -> None:
        async with self._changed:
            self._arrived[version] = self._arrived.get(version, 0) + 1
            self._changed.notify_all()

    async def sent(self, version: int) -> None:
        async with self._changed:
            self._sent.add(version)
            self._changed.notify_all()

    async def _wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        import asyncio

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(done), timeout_s)
            except asyncio.TimeoutError:
                return False
        return True

    async def wait_arrived(self, version: int, receivers: int, timeout_s: float) -> bool:
        return await self._wait(lambda: self._arrived.get(version, 0) >= receivers, timeout_s)

    async def wait_sent(self, version: int, timeout_s: float) -> bool:
        return await self._wait(lambda: version in self._sent, timeout_s)


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
