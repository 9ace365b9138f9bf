"""How long each task of a plan takes, from FLOPs, bytes and link bandwidths.

Profiles are data (``verl_digen/sim/profiles/*.yaml``, every constant with its source); this
module turns a *model* profile, a *workload* (resolution, frames, steps, CFG, SDE window,
group size, LoRA or full fine-tuning, PPO mini-batches), *device* profiles (what the hardware
costs), a *system* profile (what a training system does: what it recomputes, offloads and
reloads, where its reward model lives, its per-step overhead) and a *reward* profile into
seconds per task. ``docs/cost_model.md`` gives every formula with its source.

- **generate** ``n`` images: prompt encoding (first step only) + ``steps`` denoiser forwards
  (both CFG branches) + VAE decode (last step only). A forward on one sample costs
  ``2 x token_params x tokens + 4 x layers x tokens^2 x hidden`` FLOPs: ``token_params`` are
  the weights one token passes through (an MMDiT's image and text streams have separate
  weights, so a token meets about a third of Qwen-Image's or half of FLUX's parameters). The
  efficiency grows with the tokens of one forward, ``mfu x t / (t + mfu_half_tokens)``.
- **reward** ``n`` images: the reward model's FLOPs, plus, for a generative judge, its decoding
  tail; a reward model that shares the training devices and sleeps between steps (``swap``)
  also pays its wake-up and sleep.
- **train** ``n`` images: every trained time step is one forward + backward per device
  micro-batch (the backward of frozen LoRA base weights skips their weight gradient; activation
  checkpointing recomputes the forward) with FSDP collectives over the training ranks, of which a
  fraction hides behind compute. A system that recomputes the behaviour log-probs adds one
  forward per trained step.
- **optimizer_step**: one Adam update per PPO mini-batch, plus the system's per-step overhead.
- **sync**: gather the trainable weights on trainer 0, broadcast them to the rollout pool.
- **switch** (a worker changing between generating and training): parameter and optimizer
  offload over the host link as the system does it, reloading the new weights into the rollout
  engine (gather + load), plus a fixed cost (the engines' sleep and wake).

The interface is :meth:`CostModel.task_seconds` ``(task, worker, cluster, switch_from)``.
It reads the optional task fields the strategies set, so new strategies are costed by data:

- ``task.denoise = (start, end)`` on a GENERATE task covers only those denoising steps (a
  TSP rollout stage): prompt encoding only when ``start == 0``, VAE decoding only on the
  stage with ``task.final``;
- ``task.train_part = (part, parts)`` on a TRAIN task trains every ``parts``-th trained step
  from ``part`` (TSP training split by time step);
- a GENERATE task on a ``trainer`` worker (TAG) is costed on that worker's device; the mode
  switch (train -> generate -> train) is charged through ``switch_from``.

The zero-bubble bound (:meth:`CostModel.zero_bubble_bound`) is the optimum of a small linear
program over the cluster's device types (:mod:`verl_digen.sim.bound`).

The parts live in :mod:`verl_digen.sim.costs`, one concern a module (profiles, the catalog, the
cluster, shapes, FSDP traffic, memory, phases, rewards, weight sync, elastic shares, tasks,
bounds); this module composes :class:`CostModel` from them and re-exports their names.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Iterable, Mapping

from verl_digen.schedule.plan import Task, WorkerId
from verl_digen.schedule.strategies import StepCosts, StrategySpec
from verl_digen.sim.costs.bounds import BoundCosts
from verl_digen.sim.costs.catalog import IGNORED_SECTIONS, PROFILE_DIR, SECTIONS, Catalog  # noqa: F401
from verl_digen.sim.costs.catalog import builtin_profile_files, load_catalog  # noqa: F401
from verl_digen.sim.costs.cluster import Cluster, PoolPlacement, TrainGroup, training_pool  # noqa: F401
from verl_digen.sim.costs.elastic import ElasticCosts
from verl_digen.sim.costs.fsdp_traffic import FsdpTraffic
from verl_digen.sim.costs.memory_bytes import TrainingBytes
from verl_digen.sim.costs.memory_fit import ROLE_POOLS, MemoryFit
from verl_digen.sim.costs.phases import PhaseCosts, _passes  # noqa: F401
from verl_digen.sim.costs.profiles import (  # noqa: F401
    GB,
    GIB,
    OURS,
    RESIDENT,
    SWAP,
    TFLOP,
    WORKLOAD_KEYS,
    DeviceProfile,
    ModelProfile,
    ProfileError,
    RewardProfile,
    SystemProfile,
    Workload,
)
from verl_digen.sim.costs.rewards import RewardCosts
from verl_digen.sim.costs.shapes import WorkloadShapes
from verl_digen.sim.costs.tasks import MODE_GENERATE, MODE_TRAIN, TaskCosts  # noqa: F401
from verl_digen.sim.costs.weight_sync import WeightSync


# ---------------------------------------------------------------------------- the model

# The model's fields (profiles and a workload), its construction and summary; its costs come from
# one mixin per concern (verl_digen/sim/costs/: shapes, FSDP traffic, memory, phases, rewards,
# weight sync, elastic shares, tasks, bounds).
@dataclass(frozen=True)
class CostModel(WorkloadShapes, FsdpTraffic, MemoryFit, TrainingBytes, PhaseCosts, RewardCosts, WeightSync,
                ElasticCosts, TaskCosts, BoundCosts):
    model: ModelProfile
    workload: Workload
    devices: Mapping[str, DeviceProfile]
    system: SystemProfile = field(default_factory=SystemProfile)
    reward: RewardProfile | None = None
    # The training efficiency the zero-bubble bound charges, as a multiple of mfu_train: the best
    # train_efficiency of the catalog's systems (one bound for every system on the same work).
    bound_train_efficiency: float = 1.0
    # train_seconds by its arguments, train_group by cluster: a gang task costs every rank the
    # same call, and a plan repeats a few shapes thousands of times. Pure: every field above is
    # frozen; ``replace`` starts a new model with empty memos.
    _seconds_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _group_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _memory_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # task_seconds and contention_factor read a worker's pool and device type, nothing else of it
    # (the simulator costs a gang's alike members once: SimulatedExecutor._start)
    alike_by_pool_and_device: ClassVar[bool] = True

    @classmethod
    def from_catalog(
        cls,
        catalog: Catalog,
        model: str,
        devices: Iterable[str] | None = None,
        *,
        system: str | None = None,
        **workload: Any,
    ) -> "CostModel":
        """``workload`` overrides the model profile's defaults (any :class:`Workload` field);
        ``system`` names a system profile (default: the one the devices run with)."""
        m = catalog.model(model)
        unknown = set(workload) - set(WORKLOAD_KEYS)
        if unknown:
            raise ProfileError(f"unknown workload keys {sorted(unknown)}; valid: {', '.join(WORKLOAD_KEYS)}")
        wl = dict(m.defaults)
        wl.update({k: v for k, v in workload.items() if v is not None})
        try:
            w = Workload(**wl)
        except TypeError as e:
            raise ProfileError(f"model {model!r} workload: {e}") from None
        if w.mini_batches < 1:
            raise ProfileError(f"workload mini_batches={w.mini_batches}; must be >= 1")
        if w.optimizer_tasks < 1 or w.mini_batches % w.optimizer_tasks:
            raise ProfileError(f"workload optimizer_tasks={w.optimizer_tasks}; must divide mini_batches={w.mini_batches}")
        names = list(devices) if devices is not None else list(catalog.devices)
        devs = {n: catalog.device(n) for n in names}
        if system is None:
            systems = {d.system for d in devs.values()}
            if len(systems) > 1:
                raise ProfileError(f"devices {', '.join(names)} use different system profiles {sorted(systems)}")
            system = systems.pop() if systems else None
        sys_profile = catalog.system(system) if system is not None else SystemProfile()
        if sys_profile.reward_residency not in (RESIDENT, SWAP):
            raise ProfileError(f"system {sys_profile.name!r}: reward_residency={sys_profile.reward_residency!r}; "
                               f"valid: {RESIDENT}, {SWAP}")
        reward_name = w.reward if w.reward is not None else m.reward
        reward = catalog.reward(reward_name) if reward_name else None
        best = max([s.train_efficiency for s in catalog.systems.values()] + [sys_profile.train_efficiency])
        return cls(model=m, workload=w, devices=devs, system=sys_profile, reward=reward, bound_train_efficiency=best)

    def with_workload(self, **changes: Any) -> "CostModel":
        return replace(self, workload=replace(self.workload, **changes))

    def with_system(self, system: SystemProfile) -> "CostModel":
        return replace(self, system=system)

    def for_spec(self, spec: StrategySpec) -> "CostModel":
        """This model for one strategy: its transformer calls' rows (the runtime's
        :func:`~verl_digen.schedule.strategies.call_rows`: FSDP ranks or row slices, sample split) and whether
        its training state is sharded. The simulator and the planner cost every strategy through it."""
        from verl_digen.schedule.strategies import call_rows

        sharded = bool(getattr(spec, "fsdp", False)) or self.system.always_sharded
        ranks = len(spec.trainers) if getattr(spec, "fsdp", False) else 1
        ranks *= getattr(spec, "train_slices", 1)  # row slices deal a micro-batch's calls as FSDP ranks do
        rows = call_rows(spec.group_size, spec.train_micro_batch_groups, ranks, spec.sample_split,
                         getattr(spec, "train_micro_batch_rows", None))
        tasks = getattr(spec, "mini_batches", 1)
        # A plan with an optimizer step per mini-batch fixes the mini-batches; a plan with one
        # keeps the workload's (a published run's system stepping k times inside one task).
        minis = tasks if tasks > 1 else self.workload.mini_batches
        return self.with_workload(call_rows=rows, fsdp=sharded, mini_batches=minis, optimizer_tasks=tasks,
                                  groups_per_task=spec.groups_per_task, micro_batch_groups=spec.train_micro_batch_groups,
                                  tag=bool(getattr(spec, "tag", False)),
                                  gat=bool(getattr(spec, "gat", False)))

    def device(self, name: str) -> DeviceProfile:
        if name not in self.devices:
            raise ProfileError(f"device {name!r} is not in this cost model ({', '.join(self.devices)})")
        return self.devices[name]

    def describe(self, cluster: Cluster | None = None) -> dict[str, Any]:
        image, seq = self.tokens()
        out = {
            "model": self.model.name,
            "system": self.system.name,
            "reward": self.reward.name if self.reward else None,
            "workload": asdict(self.workload),
            "image_tokens": image,
            "sequence_tokens": seq,
            "token_params": self.token_params,
            "forward_tflops_per_sample": self.forward_flops() / TFLOP,
            "train_flops_factor": self.train_flops_factor,
            "gradient_checkpointing": self.gradient_checkpointing,
            "trainable_params": self.trainable_params,
            "sync_gb": self.sync_bytes / GB,
        }
        if not self.plans_memory:  # another system's memory, estimated (the memory planner's: per role below)
            out["activation_gb_per_sample"] = self.activation_bytes_per_sample() / GB
        if cluster is not None:
            group = self.train_group(cluster)
            dev = self.device(cluster.placement(training_pool(cluster)).device)
            out["train_device_batch"] = self.pass_batch(dev, group)
            out["checkpointing_decided"] = self.checkpointing(dev, group, training_pool(cluster))
            if self.plans_memory:
                out["peak_gib_per_gpu"] = {ROLE_POOLS[p.role]: round(p.peak_gib, 2) for p in self.memory_plans(cluster)}
            else:
                out["state_gb_per_rank"] = self.state_bytes_per_rank(group) / GB
            out["usd_per_hour"] = self.usd_per_hour(cluster)
        return out


# ---------------------------------------------------------------------------- fixed costs


@dataclass
class TableCostModel:
    """Fixed seconds per task kind (plus per image), for hand-computed timelines, tests and
    the emulated runtime's self-check. Same interface as :class:`CostModel`.

    ``seconds[kind] + per_image[kind] * images``; ``switch`` is added when a worker changes
    between generating and training (0 disables it).
    """

    seconds: Mapping[str, float]
    per_image: Mapping[str, float] = field(default_factory=dict)
    switch: float = 0.0
    group_size: int = 1

    mode_of = staticmethod(CostModel.mode_of)
    initial_mode = staticmethod(CostModel.initial_mode)

    def task_seconds(
        self, task: Task, worker: WorkerId, cluster: Cluster | None = None, *, switch_from: str | None = None
    ) -> float:
        kind = task.kind.value
        images = task.images or len(task.groups) * self.group_size
        t = self.seconds.get(kind, 0.0) + self.per_image.get(kind, 0.0) * images
        to = self.mode_of(task, worker)
        if self.switch and switch_from is not None and to is not None and to != switch_from:
            t += self.switch
        return t

    def step_costs(self, spec: StrategySpec, cluster: Cluster | None = None) -> StepCosts:
        def per_group(kind: str, groups: int) -> float:
            return (self.seconds.get(kind, 0.0) + self.per_image.get(kind, 0.0) * groups * spec.group_size) / groups

        return StepCosts(
            generate_per_group=per_group("generate", spec.groups_per_task),
            reward_per_group=per_group("reward", spec.groups_per_task),
            train_per_group=per_group("train", spec.train_micro_batch_groups),
            optimizer_step=self.seconds.get("optimizer_step", 0.0),
            sync=self.seconds.get("sync", 0.0),
        )

    def zero_bubble_bound(self, devices: Iterable[str]) -> float:
        """Devices over the per-image share of the generate, reward and train work (no
        fixed per-task share: a schedule could batch everything into one task)."""
        per_image = sum(self.per_image.get(k, 0.0) for k in ("generate", "reward", "train"))
        n = len(list(devices))
        return n / per_image if per_image > 0 else math.inf
