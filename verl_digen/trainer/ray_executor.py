"""Runs plans on Ray actors with non-blocking calls: the phases of a FlowGRPO step.

Each task kind is one phase method here (generate, reward, train with its advantages,
optimizer step, sync), each issuing one actor call per worker; trajectories travel generate -> reward -> train as
Ray object refs (the driver never materialises latents), while the small reward vectors are
fetched by the driver, which computes the group-normalised advantages.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
import torch

from verl_digen.algos.advantages import group_advantages
from verl_digen.memory.measure import max_peaks
from verl_digen.schedule.plan import Plan, Task, TaskKind, WorkerId
from verl_digen.schedule.runner import PlanRunner
from verl_digen.workers.messages import (
    GenerateRequest,
    OptimizerRequest,
    OptimizerResult,
    RewardResult,
    SyncResult,
    TrainRequest,
    TrainResult,
)


_PHASE = {
    TaskKind.GENERATE: "generate",
    TaskKind.REWARD: "reward",
    TaskKind.TRAIN: "train",
    TaskKind.OPTIMIZER_STEP: "optimizer_step",
    TaskKind.SYNC: "sync",
}


if TYPE_CHECKING:
    from verl_digen.schedule.strategies import StrategySpec


def gang_chunk_rows(spec: StrategySpec) -> int:
    """The rows per generate-output chunk for ``spec``'s executor: the transformer call's rows
    (:func:`~verl_digen.schedule.strategies.call_rows`, what the workers' ``rank_rows`` deals) when
    an FSDP gang of several ranks trains; 0 (whole outputs) otherwise."""
    from verl_digen.schedule.strategies import call_rows

    ranks = len(spec.trainers)
    if not spec.fsdp or ranks < 2:
        return 0
    return call_rows(spec.group_size, spec.train_micro_batch_groups, ranks, spec.sample_split, spec.train_micro_batch_rows)


def rank_chunks(groups: tuple[int, ...], group_size: int, chunk_rows: int, rank: int, ranks: int) -> list[tuple[int, int]]:
    """The generate-output chunks ``(group, first sample)`` holding the rows FSDP rank ``rank`` of
    ``ranks`` trains of a micro-batch of ``groups`` (its rows group-major): chunk ``c`` is rows
    ``[c * chunk_rows, (c + 1) * chunk_rows)``, dealt round-robin as
    :func:`~verl_digen.workers.sampling.rank_rows` deals them."""
    per = group_size // chunk_rows
    return [(groups[c // per], (c % per) * chunk_rows) for c in range(rank, len(groups) * per, ranks)]


class WorkerFailure(RuntimeError):
    """A worker process died or a task on it raised; names the worker and its pool."""


class WorkerDied(WorkerFailure):
    """A worker process died (not a task that raised): ``workers`` names the dead ones. What
    ``digen.fault.restarts`` restarts the run's workers for."""

    def __init__(self, message: str, workers: list[WorkerId]) -> None:
        super().__init__(message)
        self.workers = workers


@dataclass
class StepResults:
    """What the driver gathered for one training step."""

    rewards: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> [G]
    reward_extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # name -> per-call values
    rollout_rows: list[dict[str, Any]] = field(default_factory=list)  # digen.rollout_data_dir: one per sample
    versions: dict[int, int] = field(default_factory=dict)  # group -> weights version it was sampled with
    train: list[TrainResult] = field(default_factory=list)
    optimizer: list[OptimizerResult] = field(default_factory=list)  # one per PPO mini-batch
    sync: list[SyncResult] = field(default_factory=list)
    trajectory_bytes: int = 0  # measured bytes of the step's generate outputs (RewardResult.trajectory_bytes)
    # pool -> the max of its workers' memory peaks reported with the step's results (the results'
    # ``memory``, memory/measure.py interval_peaks); a pool that reported nothing is absent
    memory: dict[str, dict[str, float]] = field(default_factory=dict)

    def add_memory(self, pool: str, peaks: dict[str, float]) -> None:
        if peaks:
            self.memory[pool] = max_peaks(self.memory.get(pool, {}), peaks)


class RayPlanExecutor(PlanRunner):
    def __init__(
        self,
        plan: Plan,
        actors: dict[WorkerId, Any],
        *,
        std_mode: str,
        timeout_s: float,
        std_correction: float = 0.0,
        chunk_rows: int = 0,
        sharded_trainers: bool = False,
    ) -> None:
        """``chunk_rows > 0`` (an FSDP gang of several ranks trains): final generate tasks return
        one object per ``chunk_rows`` samples of one group (the transformer calls rank_rows deals
        to the ranks), and each rank is sent its chunks only, not every rank every output.
        ``sharded_trainers`` (FSDP): every trainer rank receives GAT's gradients and adds its
        shard of them; otherwise trainer 0 adds them whole before the all-reduce.
        ``timeout_s``: how long the executor waits for some task to finish, the plan's deadline
        (:class:`~verl_digen.sim.deadlines.Deadlines` ``task_s``: past the longest task's)."""
        super().__init__(plan)
        self.actors = actors
        self.std_mode = std_mode
        # the std's divisor n - std_correction (digen.algo.std_estimator: 0 population, 1/T veRL-Omni's)
        self.std_correction = std_correction
        self.timeout_s = timeout_s
        # The longest the executor waited for a task to finish since the last step's metrics
        # (``executor/longest_wait_s``): what its deadline must outlast.
        self.longest_wait_s = 0.0
        self.prompts: dict[int, tuple[int, str]] = {}  # group -> (prompt index, prompt)
        self.metadata: dict[int, dict[str, Any]] = {}  # group -> its prompt's record (reaches the reward)
        self.chunk_rows = chunk_rows
        self.sharded_trainers = sharded_trainers
        self.outputs: dict[str, list[ray.ObjectRef]] = {}  # generate task id -> its output's refs
        self.chunk_refs: dict[tuple[int, int], ray.ObjectRef] = {}  # (group, first sample) -> its chunk
        self.gen_of_group: dict[int, list[str]] = {}  # group -> its final generate tasks (sample slices)
        self.row_groups: dict[int, torch.Tensor] = {}
        self.results: dict[int, StepResults] = defaultdict(StepResults)
        self._refs: dict[str, list[ray.ObjectRef]] = {}
        self._ref_task: dict[ray.ObjectRef, str] = {}
        self._finished_refs: dict[str, list[tuple[int, Any]]] = defaultdict(list)  # (position in _refs, value)
        # GAT: (step, mini-batch) -> (micro-batch, its groups, ref of its Gradients) from rollout workers
        self.assisted_gradients: dict[tuple[int, int], list[tuple[int, tuple[int, ...], ray.ObjectRef]]] = \
            defaultdict(list)

    def now(self) -> float:
        return time.time()

    # ------------------------------------------------------------------ the phases of a step
    #
    # FlowGRPO, one method per task kind, in the order a group goes through them: sample the
    # group with SDE log-probs -> score it -> normalise rewards within the group -> train on it
    # -> step the optimizer -> hand the weights to rollout. The plan decides where and when
    # each runs (colocated, disaggregated, GAP, TSP, TAG, TCSS); each method only issues the
    # non-blocking actor calls and returns their refs.

    def generate(self, task: Task) -> list[ray.ObjectRef]:
        """Sample the task's groups (or one TSP stage of them) with behaviour log-probs."""
        request = GenerateRequest(
            group_ids=tuple(task.groups),
            prompts=tuple(self.prompts[g][1] for g in task.groups),
            prompt_indices=tuple(self.prompts[g][0] for g in task.groups),
            metadata=tuple(self.metadata.get(g, {}) for g in task.groups),
            step=task.step,
            version=task.version,
            denoise=tuple(task.denoise) if task.denoise is not None else None,
            samples=tuple(task.samples) if task.samples is not None else None,
        )
        # A TSP stage after the first takes the previous stage's in-flight state.
        prev = [d for d in task.deps if self.plan[d].kind == TaskKind.GENERATE]
        args = [self.outputs.pop(prev[0])[0]] if prev else []
        per_group = task.images // len(task.groups)  # this task's samples of each group
        chunks = len(task.groups) * per_group // self.chunk_rows if (self.chunk_rows and task.final) else 1
        method = self.actors[task.worker].generate
        if chunks > 1:
            request = dataclasses.replace(request, chunk_rows=self.chunk_rows)
            refs = list(method.options(num_returns=chunks).remote(request, *args))
        else:
            refs = [method.remote(request, *args)]
        if self.chunk_rows and task.final:  # one chunk: the whole output is it
            first = task.samples[0] if task.samples is not None else 0
            per = per_group // self.chunk_rows
            for k, ref in enumerate(refs):
                self.chunk_refs[(task.groups[k // per], first + (k % per) * self.chunk_rows)] = ref
        self.outputs[task.id] = refs
        if task.final:
            for g in task.groups:
                self.gen_of_group.setdefault(g, []).append(task.id)
        return refs

    def reward(self, task: Task) -> list[ray.ObjectRef]:
        """Score the groups once all their samples are in (every slice's trajectories, reassembled)."""
        gen_ids = self.gen_of_group[task.groups[0]]
        return [self.actors[task.worker].compute_reward.remote(*[r for i in gen_ids for r in self.outputs[i]])]

    def advantages(self, task: Task) -> torch.Tensor:
        """GRPO: rewards normalised within each group (or over the step, ``std_mode=global``)."""
        res = self.results[task.step]
        rows = torch.cat([res.rewards[g] for g in task.groups])
        ids = torch.cat([torch.full_like(res.rewards[g], g, dtype=torch.long) for g in task.groups])
        if self.std_mode != "global":
            return group_advantages(rows, ids, std_mode=self.std_mode, correction=self.std_correction)
        # Global std: normalise by the whole step's std (all rewards are in: no GAP).
        all_rows = torch.cat([res.rewards[g] for g in sorted(res.rewards)])
        all_ids = torch.cat([torch.full_like(res.rewards[g], g, dtype=torch.long) for g in sorted(res.rewards)])
        adv = group_advantages(all_rows, all_ids, std_mode="global", correction=self.std_correction)
        by_group = {g: adv[all_ids == g] for g in sorted(res.rewards)}
        return torch.cat([by_group[g] for g in task.groups])

    def train(self, task: Task) -> list[ray.ObjectRef]:
        """One micro-batch: recompute log-probs, clipped surrogate (+KL), accumulate gradients."""
        gen_ids = sorted({i for g in task.groups for i in self.gen_of_group[g]})
        part = tuple(task.train_part) if task.train_part is not None else None
        request = TrainRequest(groups=tuple(task.groups), advantages=self.advantages(task), train_part=part)
        inputs = [r for i in gen_ids for r in self.outputs[i]]
        if task.worker.pool == "rollout":  # GAT: the gradients stay in the object store for trainer 0
            request = dataclasses.replace(request, return_gradients=True)
            result, gradients = self.actors[task.worker].train_micro_batch.options(num_returns=2).remote(request, *inputs)
            self.assisted_gradients[(task.step, task.mini_batch)].append((task.id.micro_batch, tuple(task.groups), gradients))
            return [result]
        if len(task.workers) == 1:
            if task.row_part is not None:  # a row slice of the micro-batch, pulled by this trainer
                request = dataclasses.replace(request, row_part=tuple(task.row_part))
            return [self.actors[task.worker].train_micro_batch.remote(request, *inputs)]
        n = len(task.workers)  # FSDP gang: every rank, in lockstep, on its share of the samples
        if not self.chunk_rows:
            return [self.actors[w].train_micro_batch.remote(dataclasses.replace(request, row_part=(r, n)), *inputs)
                    for r, w in enumerate(task.workers)]
        group_size = task.images // len(task.groups)
        return [self.actors[w].train_micro_batch.remote(
                    dataclasses.replace(request, row_part=(r, n), presliced=True),
                    *[self.chunk_refs[c] for c in rank_chunks(task.groups, group_size, self.chunk_rows, r, n)])
                for r, w in enumerate(task.workers)]

    def optimizer_step(self, task: Task) -> list[ray.ObjectRef]:
        """Reduce gradients over the trainer ranks and step (one PPO mini-batch's); the step's
        last mini-batch makes weights version ``task.version``. The trainers also add the
        gradients the rollout workers computed (GAT), in micro-batch order: trainer 0 before the
        all-reduce, or every FSDP rank its shard (their gradients are reduce-scattered already)."""
        assisted = sorted(self.assisted_gradients.pop((task.step, task.mini_batch), []), key=lambda item: item[0])
        request = OptimizerRequest(mini_batch=task.mini_batch, final=task.id.mini_batch is None)
        with_gradients = dataclasses.replace(request, gradients_of=tuple(groups for _, groups, _ in assisted))
        refs = [ref for _, _, ref in assisted]
        return [self.actors[w].optimizer_step.remote(with_gradients, *refs) if r == 0 or self.sharded_trainers
                else self.actors[w].optimizer_step.remote(request)
                for r, w in enumerate(task.workers)]

    def sync(self, task: Task) -> list[ray.ObjectRef]:
        """The rollout workers receive the trained weights (LoRA-only when LoRA is on): trainer
        0 has been sending them since its optimizer step, from a side thread that waits for
        every receiver (``DiffusionWorker.optimizer_step``)."""
        return [self.actors[w].sync_recv.remote() for w in task.workers]

    def _launch(self, task: Task) -> None:
        refs = getattr(self, _PHASE[task.kind])(task)
        self._refs[task.id] = refs
        for r in refs:
            self._ref_task[r] = task.id

    # ------------------------------------------------------------------ wait

    def _wait_one(self) -> tuple[str, Any]:
        while True:
            pending = list(self._ref_task)
            t0 = time.monotonic()
            ready, _ = ray.wait(pending, num_returns=1, timeout=self.timeout_s)
            self.longest_wait_s = max(self.longest_wait_s, time.monotonic() - t0)
            if not ready:
                running = {str(tid): [str(w) for w in self.bound[tid]] for tid in self.running}
                raise WorkerFailure(
                    f"no task finished within {self.timeout_s:g} s (the plan's deadline: digen.task_timeout_s "
                    f"+ twice the longest task's predicted seconds); running: {running}. "
                    "A worker may be hung; the run stops here."
                )
            ref = ready[0]
            tid = self._ref_task.pop(ref)
            task = self.bound_task(tid)
            if task.kind == TaskKind.GENERATE:
                # Keep the trajectories in the object store; a failed generate surfaces in
                # the reward task that consumes it, with the original error attached.
                value: Any = ref
            else:
                value = self._check_ok(task, ref)
            self._finished_refs[tid].append((self._refs[tid].index(ref), value))
            if len(self._finished_refs[tid]) == len(self._refs[tid]):
                # in the order the task's refs were made (its workers'), not the order they finished
                return tid, [v for _, v in sorted(self._finished_refs.pop(tid), key=lambda iv: iv[0])]

    def _check_ok(self, task: Task, ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            dead = self._dead_workers()
            if dead:
                # Name the worker that died, not the task that noticed: when a rollout worker
                # dies mid-sync, its sender's collective (or a reward reading its samples)
                # fails too, and that failure can reach the driver first.
                raise WorkerDied(
                    f"worker {', '.join(f'{w} (pool {w.pool!r})' for w in dead)} died; the run noticed it "
                    f"while running {task.id} on {', '.join(str(w) for w in task.workers)}: {e.__class__.__name__}",
                    dead,
                ) from e
            if isinstance(e, ray.exceptions.RayActorError):
                raise WorkerDied(
                    f"worker {', '.join(str(w) for w in task.workers)} (pool '{task.worker.pool}') died while "
                    f"running {task.id}: {e.__class__.__name__}",
                    list(task.workers),
                ) from e
            raise WorkerFailure(
                f"task {task.id} failed on {', '.join(str(w) for w in task.workers)}: "
                f"{type(e.cause).__name__}: {e.cause}"  # str, not repr: a traceback inside keeps its lines
            ) from e

    def _dead_workers(self, grace_s: float = 10.0) -> list[WorkerId]:
        """The workers whose process is gone. A dead actor answers a ping with RayActorError at
        once; a live one answers or is busy (no answer within ``grace_s``), either way alive."""
        pings = {self.actors[w].ping.remote(): w for w in self.actors}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=grace_s)
        dead = []
        for ref in ready:
            try:
                ray.get(ref, timeout=grace_s)
            except ray.exceptions.RayActorError:
                dead.append(pings[ref])
            except Exception:  # noqa: BLE001 - any other answer means the process is there
                pass
        return sorted(dead, key=str)

    # ------------------------------------------------------------------ collect

    def _on_finish(self, task: Task, result: Any, start: float, end: float) -> None:
        res = self.results[task.step]
        if task.kind in (TaskKind.REWARD, TaskKind.TRAIN, TaskKind.OPTIMIZER_STEP):
            # every worker's report, each in its pool (result[i] is bound worker i's; a pulled
            # task's pool is its candidates', one pool)
            for w, r in zip(self.bound.get(task.id, task.workers), result):
                res.add_memory(w.pool, getattr(r, "memory", {}))
        if task.kind == TaskKind.REWARD:
            out: RewardResult = result[0]
            gens = self.gen_of_group.get(task.groups[0])
            if out.generator_memory and gens:  # the generating workers' peaks, carried in their outputs
                res.add_memory(self.bound.get(gens[0], self.plan[gens[0]].workers)[0].pool, out.generator_memory)
            for g in task.groups:
                res.rewards[g], res.versions[g] = out.of_group(g)
            for name, values in out.extra.items():
                res.reward_extras.setdefault(name, []).append(values)
            res.rollout_rows.extend(out.rollout_rows)
            res.trajectory_bytes += out.trajectory_bytes
        elif task.kind == TaskKind.TRAIN:
            res.train.extend(result)
        elif task.kind == TaskKind.OPTIMIZER_STEP:
            # trainer 0's (the first worker's): the weight sender, whose result also says how long its send waited
            res.optimizer.append(result[0])
            if task.id.mini_batch is not None:
                return  # a mini-batch before the last: the step's trajectories are still to train
            # The step's trajectories are trained: free them from the object store.
            for g in [g for g, tids in self.gen_of_group.items() if self.plan[tids[0]].step == task.step]:
                for tid in self.gen_of_group.pop(g):
                    self.outputs.pop(tid, None)
                for key in [k for k in self.chunk_refs if k[0] == g]:
                    del self.chunk_refs[key]
        elif task.kind == TaskKind.SYNC:
            res.sync.append(result[0])

    def _record_extra(self, task: Task, result: Any) -> dict[str, Any]:
        if task.kind == TaskKind.SYNC:
            return {"bytes": result[0].nbytes}
        return {}

    def step_metrics(self, step: int) -> dict[str, Any]:
        """What ``step`` learned: rewards, staleness, the trainers' ``actor/*`` means, the
        optimizer's statistics; and what it held: ``memory/<pool>/*``, each pool's largest memory
        peaks over the step's reports (the device's reserved and allocated, the host's)."""
        res = self.results[step]
        rewards = torch.cat([res.rewards[g] for g in sorted(res.rewards)])
        m: dict[str, Any] = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "max_staleness_seen": int(max((t.staleness_max for t in res.train), default=0)),
        }
        for k in sorted({k for t in res.train for k in t.metrics if k.startswith("actor/")}):
            values = [t.metrics[k] for t in res.train if k in t.metrics]
            m[k] = float(sum(values) / len(values))
        for name in sorted(res.reward_extras):  # a custom reward's extra numbers: means over the samples with one
            values = torch.cat(res.reward_extras[name])
            values = values[~torch.isnan(values)]
            if len(values):
                m[f"reward/{name}"] = float(values.mean())
        for k in sorted({k for o in res.optimizer for k in o.metrics}):  # over the mini-batches' steps:
            values = [o.metrics[k] for o in res.optimizer if k in o.metrics]  # skipped ones counted, the rest means
            m[k] = float(sum(values) if k == "actor/skipped_nonfinite" else sum(values) / len(values))
        m["actor/optimizer_steps"] = len(res.optimizer)
        m["executor/longest_wait_s"], self.longest_wait_s = self.longest_wait_s, 0.0
        if res.trajectory_bytes:  # real workers measure it (emulated ones carry no trajectories)
            m["perf/object_store_bytes"] = res.trajectory_bytes
        for pool in sorted(res.memory):  # real workers measure it (emulated ones report nothing)
            for key in sorted(res.memory[pool]):
                m[f"memory/{pool}/{key}"] = float(res.memory[pool][key])
        m["policy_version"] = step + 1
        return m
