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
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Iterable, Mapping

from verl_digen.schedule.plan import Task, TaskKind, WorkerId
from verl_digen.schedule.strategies import StepCosts, StrategySpec
from verl_digen.sim.bound import max_throughput
from verl_digen.sim.costs.catalog import IGNORED_SECTIONS, PROFILE_DIR, SECTIONS, Catalog  # noqa: F401
from verl_digen.sim.costs.catalog import builtin_profile_files, load_catalog  # noqa: F401
from verl_digen.sim.costs.cluster import Cluster, PoolPlacement, TrainGroup, _memoised, training_pool  # noqa: F401
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

MODE_GENERATE = "generate"
MODE_TRAIN = "train"


# The memory planner's roles (memory/plan.py) and the pools that hold them.
ROLE_POOLS = {"colocated": "fused", "rollout": "rollout", "trainer": "trainer", "reward": "reward"}

# What a role does in each of the memory planner's phases (memory/plan.py), for the planner's messages.
_PHASE_WORDS = {"load": "loading the model", "warm": "warming the prompt cache", "encode": "encoding prompts",
                "generate": "generating", "decode": "decoding", "train": "training", "step": "the optimizer step",
                "sync": "the weight sync", "score": "scoring"}


def _memory_problem(plan: Any, job: Any, pool: str, cluster: Cluster, reward: str = "") -> str:
    """One pool that does not fit, from the memory planner's ``RolePlan`` of its role: the pool,
    what it does at its peak, the GiB by category, the device."""
    gib = 1 << 30
    device = cluster.placement(pool).device
    what = _PHASE_WORDS.get(plan.phase, plan.phase)
    if plan.phase == "train" and plan.role == "rollout":
        what = "training a GAT micro-batch"
    if plan.role == "reward":
        what = f"scoring with {reward} ({job.reward_bytes / gib:.1f} GiB of weights in its dtype)"
    parts = ", ".join(f"{k.replace('_', ' ')} {v / gib:.1f}" for k, v in plan.bytes.items() if v)
    if plan.phase in ("train", "step"):
        sharded = 1 if plan.role == "rollout" else job.fsdp
        parts += f"; training state {f'{sharded}-way sharded' if sharded > 1 else 'unsharded'}"
    if plan.phase == "train":
        parts += (f", activations for a pass of {job.pass_samples} sample(s), "
                  f"{'checkpointed' if job.checkpointing else 'without checkpointing'}")
    return (f"{pool}: {what} holds {plan.peak_gib:.1f} GiB per GPU ({parts}), more than the "
            f"{plan.device_gib:g} GiB of one {device}")


# ---------------------------------------------------------------------------- the model




def _passes(images: int, batch: int) -> list[int]:
    """Samples per pass when ``images`` are cut into passes of at most ``batch``."""
    full, rest = divmod(images, batch)
    return [batch] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class CostModel:
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
        rows = call_rows(spec.group_size, spec.train_micro_batch_groups, ranks, spec.sample_split)
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

    # ------------------------------------------------------------------ shapes and FLOPs

    @property
    def text_tokens(self) -> int:
        w = self.workload
        return self.model.text_tokens if w.text_tokens is None else w.text_tokens

    def tokens(self) -> tuple[int, int]:
        """(image or video tokens, sequence length of the self-attention)."""
        m, w = self.model, self.workload
        lat_f = (w.frames - 1) // m.vae_temporal + 1 if m.video else 1
        lat_h, lat_w = w.height // m.vae_spatial, w.width // m.vae_spatial
        image = max(1, lat_f // m.patch_t) * max(1, lat_h // m.patch) * max(1, lat_w // m.patch)
        seq = image + (self.text_tokens if m.joint_text else 0)
        return image, seq

    @property
    def token_params(self) -> float:
        return self.model.token_params or self.model.params

    def linear_flops(self) -> float:
        """FLOPs of the linear layers of one forward on one sample (one CFG branch)."""
        return 2.0 * self.token_params * self.tokens()[1]

    def attention_flops(self) -> float:
        """FLOPs of attention scores and values of one forward on one sample (one branch)."""
        m = self.model
        image, seq = self.tokens()
        flops = 4.0 * m.layers * seq * seq * m.hidden
        if not m.joint_text and self.text_tokens:
            flops += 4.0 * m.layers * image * self.text_tokens * m.hidden  # cross-attention scores/values
        return flops

    def forward_flops(self) -> float:
        """FLOPs of one denoiser forward on one sample (one CFG branch)."""
        return self.linear_flops() + self.attention_flops()

    @property
    def gradient_checkpointing(self) -> bool | None:
        """The configured activation checkpointing: the workload's, else the model profile's;
        None: decided per training pass by memory (:meth:`checkpointing`)."""
        w = self.workload
        return self.model.gradient_checkpointing if w.gradient_checkpointing is None else w.gradient_checkpointing

    def train_flops(self, checkpointing: bool = False) -> float:
        """FLOPs of one trained sample-step (one CFG branch): forward, backward (input gradients
        of every linear layer, weight gradients of the trainable ones only: a frozen LoRA base
        skips them; attention's backward is twice its forward), a recomputed forward with
        activation checkpointing (``checkpointing``), a reference forward with KL."""
        lin, att = self.linear_flops(), self.attention_flops()
        backward_linear = 1.0 if self.workload.lora else 2.0
        flops = lin * (1.0 + backward_linear) + 3.0 * att
        if checkpointing:
            flops += lin + att
        if self.workload.kl:
            flops += lin + att
        return flops

    @property
    def train_flops_factor(self) -> float:
        """Forward-equivalents per trained sample-step (``train_flops / forward_flops``), with
        the configured checkpointing (none when undecided)."""
        return self.train_flops(bool(self.gradient_checkpointing)) / self.forward_flops()

    @property
    def param_bytes(self) -> float:
        return 2.0 * self.model.params  # bf16

    @property
    def trainable_params(self) -> float:
        w, m = self.workload, self.model
        if w.lora:
            return m.lora_params or 2.0 * w.lora_rank * m.hidden * m.lora_linears
        return m.params

    @property
    def sync_bytes(self) -> float:
        return 2.0 * self.trainable_params  # bf16 weights (LoRA factors or the full model)

    def object_store_bytes(self) -> int | None:
        """Bytes of one step's trajectory records (``memory/object_store.py``: each trained step's
        latents, the uint8 pixels; text embeddings not counted, a run with a prompt cache carries
        none), from the family's real configs; None for a model profile without a family."""
        from verl_digen.memory.object_store import latent_elements, trajectory_bytes

        w, family = self.workload, self.model.family
        if not family:
            return None
        window = w.sde_window or w.num_steps
        trained = w.trained_steps
        # a whole window is consecutive steps (window + 1 latents); a subsampled one at most 2 per step
        carried = window + 1 if trained >= window else min(2 * trained, window + 1)
        sample = trajectory_bytes(num_steps=w.num_steps, carried=carried,
                                  latent_elements=latent_elements(family, None, "bf16", w.height, w.width, w.frames),
                                  pixel_elements=3 * w.frames * w.height * w.width)
        return sample.total * w.group_size * w.groups_per_step

    @staticmethod
    def efficiency(dev: DeviceProfile, tokens: float, *, train: bool = False) -> float:
        """Fraction of the peak a forward (or forward+backward) over ``tokens`` tokens reaches:
        ``mfu x t / (t + mfu_half_tokens)``, never above the device's asymptote ``mfu``."""
        m = dev.mfu_train if train else dev.mfu_forward
        h = dev.mfu_half_tokens
        return m * tokens / (tokens + h) if h > 0 and tokens > 0 else m

    # ------------------------------------------------------------------ the training pool

    def train_group(self, cluster: Cluster) -> TrainGroup:
        return _memoised(self._group_memo, cluster, self._train_group)

    def _train_group(self, cluster: Cluster) -> TrainGroup:
        group = self._plain_train_group(cluster)
        if not self.plans_memory:
            return group
        job = self.memory_job(cluster)
        return replace(group, checkpointing=job.checkpointing, optimizer_parked=group.sends and job.optimizer_offload)

    def _plain_train_group(self, cluster: Cluster) -> TrainGroup:
        """The training pool's shape, without the memory decisions."""
        p = cluster.placement(training_pool(cluster))
        sends = "rollout" in cluster.pools  # disaggregated: trainer 0 sends every version
        gat = {}
        if self.workload.gat and sends:  # GAT: rollout workers train too
            gat = dict(gat_device=cluster.placement("rollout").device)
        if self.workload.fsdp is False:  # every trainer holds the whole state and trains alone
            return TrainGroup(ranks=p.size, nodes=p.nodes, shard=1, shard_nodes=1, sends=sends, **gat)
        shard = self.system.hsdp_shard if 0 < self.system.hsdp_shard < p.size else p.size
        per_pass = False
        if shard == p.size and self.system.fsdp_mesh == "auto":  # the runtime's choice from the pool's nodes
            from verl_digen.memory.fsdp_layout import mesh_shape

            replicas, shard = mesh_shape(p.node_devices, "auto")
            per_pass = replicas > 1
        # flat FSDP spans the pool's nodes; an HSDP shard group the nodes its ranks sit on
        return TrainGroup(ranks=p.size, nodes=p.nodes, shard=shard, shard_nodes=p.group_nodes(shard), sends=sends,
                          hsdp_per_pass=per_pass, **gat)

    # ------------------------------------------------------------------ memory: the memory planner's

    @property
    def plans_memory(self) -> bool:
        """Whether memory (what fits, activation checkpointing, parked optimizer state) is the
        memory planner's (:mod:`verl_digen.memory.plan`): this runtime's workers
        (``system.memory_planner``) running a model whose family has real configs
        (``model.family``). Otherwise another system's memory is estimated from profile bytes
        (:meth:`estimated_memory_problems`), and a model without a family is not planned."""
        return self.system.memory_planner and bool(self.model.family)

    def memory_job(self, cluster: Cluster):
        """This workload on ``cluster`` as the memory planner's job (``memory.plan.JobShape``: the
        real model's configs at the workload's size, the strategy's generate calls and training
        passes, every other setting at the config's default), with the run's memory decisions made
        by the run's own rules (``memory.plan.decide_job``: parked optimizer state, activation
        checkpointing, text-encoder placement; the workload's or model profile's setting where it
        has one), each pool's GPUs at its device's memory. One per cluster object."""
        return _memoised(self._memory_memo, cluster, self._memory_job)

    def _memory_job(self, cluster: Cluster):
        from verl_digen.memory.plan import decide_job, reward_gpu_bytes, workload_job

        w, r = self.workload, self.reward
        pool = training_pool(cluster)
        colocated = pool == "fused"
        group = self._plain_train_group(cluster)
        # a served judge runs in its own inference server: the job's workers hold none of it
        reward = 0 if r is None or r.served else reward_gpu_bytes({"name": r.name}, params_of=lambda _: r.params)
        job = workload_job(
            family=self.model.family, height=w.height, width=w.width, num_frames=w.frames, num_steps=w.num_steps,
            cfg_rows=w.cfg_factor, group_size=w.group_size, groups_per_task=w.groups_per_task,
            micro_batch_samples=w.micro_batch_groups * w.group_size,
            pass_samples=self.pass_batch(self.device(cluster.placement(pool).device), group, pool),
            lora=w.lora, lora_rank=w.lora_rank, kl_reference=w.kl,
            placement="colocated" if colocated else "disaggregated",
            rollout_devices=cluster.placement("fused" if colocated else "rollout").size,
            trainer_devices=cluster.placement(pool).size,
            reward_devices=cluster.pools["reward"].size if "reward" in cluster.pools else 0,
            fsdp=group.shard, fsdp_replicas=group.replicas if group.hsdp_per_pass else 1,
            grad_reduce_bytes=int(self.grad_reduce_bytes), reward_bytes=reward, trainers_generate=w.tag,
            trainers_score=w.tag and "reward" not in cluster.pools, rollouts_train=bool(group.gat_device),
            vae_decode_chunk=w.vae_decode_chunk, devices=cluster.devices,
        )
        # fused workers park as the system does (ours: auto, parked); trainers as the workload says
        # (None: auto, the planner's rule)
        parked = self.system.optimizer_offload if colocated else w.optimizer_offload
        return decide_job(job, self.role_gib(cluster), checkpointing=self.gradient_checkpointing, optimizer_offload=parked)

    def role_gib(self, cluster: Cluster) -> dict[str, float]:
        """The memory of one GPU of each of the memory planner's roles on ``cluster``: its pool's
        device's ``hbm_gb``, in GiB as the memory planner (and the run's check) reads the device
        table (``platform/devices.py``: the datasheets' "80 GB" are 5 stacks of 16 GiB)."""
        return {role: self.device(cluster.placement(pool).device).hbm_gb
                for role, pool in ROLE_POOLS.items() if pool in cluster.pools}

    def memory_plans(self, cluster: Cluster):
        """Every role's per-GPU peak on ``cluster`` (``memory.plan.RolePlan``, the memory
        planner's), for the decided :meth:`memory_job`; empty when :attr:`plans_memory` is False."""
        if not self.plans_memory:
            return []
        from verl_digen.memory.plan import plan_roles

        return plan_roles(self.memory_job(cluster), self.role_gib(cluster))

    def held_grad_bytes_per_param(self) -> float:
        """Gradient bytes a rank holds per trained parameter: a LoRA run trains its adapters in
        their own (fp32) dtype, one gradient each; a full fine-tune holds what the system says."""
        s = self.system
        if self.workload.lora:
            return s.grad_bytes_per_param
        return s.held_grad_bytes_per_param or s.grad_bytes_per_param

    def state_bytes_per_rank(self, group: TrainGroup, parked: bool = False) -> float:
        """A training rank's weights, gradients and (unless ``parked`` on the host) optimizer state."""
        s = self.system
        held = self.held_grad_bytes_per_param() + (0.0 if parked else s.optimizer_bytes_per_param)
        return (self.param_bytes + held * self.trainable_params) / group.shard

    def optimizer_parked(self, dev: DeviceProfile, group: TrainGroup, pool: str = "trainer") -> bool:
        """Whether a disaggregated trainer keeps its optimizer state on the host between optimizer
        steps (``workers/training.py: park_optimizer``): the memory planner's decision for the
        cluster (:meth:`memory_job`: the workload's ``optimizer_offload``, else the rule of
        ``digen.model.optimizer_offload=auto``, which asks every role that trains, GAT's rollout
        workers included). Without a memory plan: as the workload says, else resident. Fused
        workers' parking is the system's switch (``optimizer_offload``), charged where they switch."""
        if pool != "trainer" or not group.sends:
            return False
        if self.plans_memory:
            return group.optimizer_parked
        return bool(self.workload.optimizer_offload) and not self.system.train_micro_batch

    def param_shard_bytes(self, group: TrainGroup) -> float:
        """The training weights one rank holds: bf16 weights, fp32 for the trainable ones."""
        return (self.param_bytes + 2.0 * self.trainable_params) / group.shard

    def optimizer_shard_bytes(self, group: TrainGroup) -> float:
        return self.system.optimizer_bytes_per_param * self.trainable_params / group.shard

    def activation_bytes_per_sample(self, checkpointing: bool = False) -> float:
        """Activations one sample keeps for its backward (both CFG branches).

        Without checkpointing every block keeps ``activation_bytes x tokens x hidden``; with
        it, only each block's bf16 input plus one block's full activations during recompute."""
        m, s = self.model, self.system
        seq = self.tokens()[1]
        per_block = s.activation_bytes * seq * m.hidden
        if checkpointing:
            act = 2.0 * m.layers * seq * m.hidden + per_block
        else:
            act = m.layers * per_block
        return act * self.workload.cfg_factor

    def pass_batch(self, dev: DeviceProfile, group: TrainGroup, pool: str = "trainer") -> int:
        """Samples per forward+backward pass on one rank: the workload's value; else, for a
        system with its own micro-batch (veRL's ``ppo_micro_batch_size_per_gpu``, which its users
        size to memory), that micro-batch or the most that fit (checkpointed when that fits more);
        else this runtime's: one transformer call's rows (``workers/training.py`` trains a
        micro-batch call by call). Never more than one rank's share of a PPO mini-batch (the
        optimizer steps between mini-batches)."""
        w = self.workload
        if w.train_device_batch:
            batch = w.train_device_batch
        elif self.system.train_micro_batch:
            cap = self.system.train_micro_batch
            configured = self.gradient_checkpointing
            fits = self._fitting_batch(dev, group, pool, bool(configured))
            if configured is None and fits < cap:
                fits = max(fits, self._fitting_batch(dev, group, pool, True))
            batch = max(1, min(cap, fits))
        else:
            batch = w.call_rows or w.group_size
        share = math.ceil(w.images_per_step / (w.mini_batches * max(1, group.ranks)))
        return max(1, min(batch, share))

    def _fitting_batch(self, dev: DeviceProfile, group: TrainGroup, pool: str, checkpointing: bool) -> int:
        """The most samples one pass fits next to the rank's state and a resident reward model."""
        free = (dev.hbm_gb * GB * self.system.memory_headroom - self.state_bytes_per_rank(group)
                - self.resident_reward_bytes(pool))
        return int(free // self.activation_bytes_per_sample(checkpointing)) if free > 0 else 0

    def resident_reward_bytes(self, pool: str) -> float:
        """A reward model's weights that stay on a device of ``pool`` while it trains: a fused
        worker's resident reward (a swapped one sleeps on the host while training)."""
        if pool == "fused" and self.reward_residency(WorkerId(pool, 0)) == RESIDENT:
            return self.reward_weight_bytes()
        return 0.0

    def training_bytes(self, dev: DeviceProfile, group: TrainGroup, pool: str, checkpointing: bool,
                       parked: bool | None = None) -> float:
        """Peak bytes of one rank in a training pass: its training state (the optimizer's unless
        ``parked``; None: :meth:`optimizer_parked`), a resident reward model, and one pass's
        activations."""
        if parked is None:
            parked = self.optimizer_parked(dev, group, pool)
        return (self.state_bytes_per_rank(group, parked) + self.resident_reward_bytes(pool)
                + self.pass_batch(dev, group, pool) * self.activation_bytes_per_sample(checkpointing))

    def checkpointing(self, dev: DeviceProfile, group: TrainGroup, pool: str = "trainer") -> bool:
        """Activation checkpointing of a training pass: as configured, else the memory planner's
        decision for the cluster (:meth:`memory_job`: what ``digen.model.gradient_checkpointing=auto``
        decides, on exactly when some role's pass, under GAT the rollout workers' too, does not fit
        without it; one decision for the run). Another system's: estimated, on exactly when its
        pass (:meth:`training_bytes`) exceeds the usable memory without it. A model without a
        memory plan trains without."""
        configured = self.gradient_checkpointing
        if configured is not None:
            return configured
        if self.plans_memory:
            return bool(group.checkpointing)
        if self.system.memory_planner:
            return False
        cap = dev.hbm_gb * GB * self.system.memory_headroom
        return self.training_bytes(dev, group, pool, False) > cap

    def run_checkpointing(self, cluster: Cluster) -> bool:
        """The run's one checkpointing decision (:meth:`checkpointing` of the training pool),
        which a GAT rollout worker trains with too."""
        pool = training_pool(cluster)
        return self.checkpointing(self.device(cluster.placement(pool).device), self.train_group(cluster), pool)

    def collective_bw(self, device: DeviceProfile, nodes: int) -> float:
        link = device.cross_node_gbps if nodes > 1 else device.intra_node_gbps
        return link * GB * self.system.nccl_efficiency

    def _ring_latency(self, k: int, collectives: int) -> float:
        return collectives * self.model.layers * (k - 1) * self.system.collective_step_latency_s

    @property
    def grad_reduce_bytes(self) -> float:
        """Bytes per trained parameter of FSDP's gradient reduction (the system's
        ``grad_reduce_dtype``; auto: the runtime's rule, memory/fsdp_layout.py ``reduce_dtype``)."""
        if self.system.grad_reduce_dtype == "auto":
            from verl_digen.memory.fsdp_layout import DTYPE_BYTES, reduce_dtype

            return float(DTYPE_BYTES[reduce_dtype("auto", lora=self.workload.lora, weights_dtype="bf16")])
        return self.system.grad_bytes_per_param

    def fsdp_pass_bytes(self, group: TrainGroup) -> dict[str, float]:
        """Bytes one rank sends in one forward+backward pass's FSDP collectives (ring, one
        direction): ``gather`` (the parameters all-gathered for the forward and again for the
        backward, within the shard group), ``reduce_scatter`` (the trained gradients, within the
        shard group) and ``all_reduce`` (HSDP run per pass: the gradient shard across replicas,
        over the network); what FSDP2's ``foreach_reduce`` moves
        (:func:`verl_digen.memory.fsdp_layout.reduce_traffic`)."""
        from verl_digen.memory.fsdp_layout import reduce_traffic

        k = group.shard
        r = group.replicas if group.hsdp_per_pass else 1
        traffic = reduce_traffic(self.trainable_params, replicas=r, shard=k, reduce_bytes=self.grad_reduce_bytes)
        gather = 2.0 * self.param_bytes * (k - 1) / k if k > 1 else 0.0
        return {"gather": gather, "reduce_scatter": traffic.reduce_scatter, "all_reduce": traffic.all_reduce}

    def fsdp_comm_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """FSDP collectives of one forward+backward pass on one rank (:meth:`fsdp_pass_bytes`):
        all-gather the parameters for the forward and again for the backward, reduce-scatter the
        trainable gradients, over the shard group's links; under HSDP run per pass, all-reduce
        each gradient shard across the replicas over the network. One collective per block each,
        every ring step paying a latency."""
        k = group.shard
        moved = self.fsdp_pass_bytes(group)
        if k <= 1 and not moved["all_reduce"]:
            return 0.0
        seconds = (moved["gather"] + moved["reduce_scatter"]) / self.collective_bw(dev, group.shard_nodes)
        seconds += self._ring_latency(k, 3) if k > 1 else 0.0
        if moved["all_reduce"]:
            seconds += moved["all_reduce"] / self.collective_bw(dev, group.nodes)
            seconds += self._ring_latency(group.replicas, 2)
        return seconds

    def fsdp_gather_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """One forward-only pass's FSDP all-gather (log-prob recomputation)."""
        k = group.shard
        if k <= 1:
            return 0.0
        return self.param_bytes * (k - 1) / k / self.collective_bw(dev, group.shard_nodes) + self._ring_latency(k, 1)

    # ------------------------------------------------------------------ per kind

    def encode_seconds(self, prompts: int, dev: DeviceProfile) -> float:
        m = self.model
        flops = 2.0 * m.text_encoder_params * m.text_encoder_tokens * prompts * self.workload.cfg_factor
        return flops / (dev.flops * (dev.encode_mfu or dev.mfu_forward))

    def denoise_seconds(self, samples: int, dev: DeviceProfile, batch: int | None = None,
                        gather_s: float = 0.0) -> float:
        """One denoising step of ``samples`` samples (both CFG branches), run as forwards of at
        most ``batch`` samples (default: one forward over all of them). ``gather_s``: the FSDP
        all-gather each forward makes when the module generating is sharded
        (:meth:`generation_gather_seconds`), hidden behind the forward's compute as a training
        pass's collectives are (:meth:`_pass_seconds`)."""
        b = max(1, min(samples, batch or samples))
        calls = math.ceil(samples / b)
        eff = self.efficiency(dev, b * self.workload.cfg_factor * self.tokens()[1])
        flops = samples * self.workload.cfg_factor * self.forward_flops()
        t = calls * dev.forward_overhead_s + flops / (dev.flops * eff)
        if gather_s:
            row = self.workload.cfg_factor * self.forward_flops() / (dev.flops * eff)
            full, rest = divmod(samples, b)
            for n, times in ((b, full), (rest, 1 if rest else 0)):
                t += times * self._exposed_comm(dev.forward_overhead_s + n * row, gather_s)
        return t

    def forward_seconds(self, samples: int, dev: DeviceProfile) -> float:
        """One denoiser call on ``samples`` samples (both CFG branches)."""
        return self.denoise_seconds(samples, dev)

    def decode_seconds(self, images: int, dev: DeviceProfile) -> float:
        w = self.workload
        flops = images * w.height * w.width * w.frames * self.model.decode_flops_per_pixel
        return flops / (dev.flops * dev.decode_mfu)

    def generate_seconds(
        self,
        images: int,
        dev: DeviceProfile,
        steps: tuple[int, int] | None = None,
        *,
        final: bool = True,
        batch: int | None = None,
        gather_s: float = 0.0,
    ) -> float:
        """Denoising steps ``[start, end)`` (all by default) of ``images`` samples in forwards of
        at most ``batch`` samples (each paying ``gather_s`` of FSDP all-gather beyond what its
        compute hides: :meth:`denoise_seconds`); prompts are encoded by the stage that starts at
        step 0, latents decoded by the ``final`` one."""
        w = self.workload
        start, end = steps if steps is not None else (0, w.num_steps)
        if not 0 <= start < end <= w.num_steps:
            raise ValueError(f"denoise steps {(start, end)} outside [0, {w.num_steps}] (workload num_steps)")
        t = dev.generate_overhead_s + (end - start) * self.denoise_seconds(images, dev, batch, gather_s)
        if start == 0:
            t += self.encode_seconds(math.ceil(images / w.group_size), dev)
        if final:
            t += self.decode_seconds(images, dev)
        return t

    def reward_flops_per_image(self) -> float:
        return self.reward.flops if self.reward is not None else self.model.reward_flops_per_image

    def reward_seconds(
        self, images: int, dev: DeviceProfile, *, residency: str = RESIDENT, per_worker: int | None = None
    ) -> float:
        """Scoring ``images`` images on a worker that scores ``per_worker`` images per step
        (default: the whole step's). A judge decodes until its longest answer ends, and each
        judge instance meets that tail once per step: a call carries its images' share of it
        (a swapped judge scores a worker's whole share in one call, so it pays all of it)."""
        t = dev.reward_overhead_s + images * self.reward_flops_per_image() / (dev.flops * dev.mfu_forward)
        r = self.reward
        if r is not None and r.decode_tail_s:
            t += r.decode_tail_s * min(1.0, images / (per_worker or self.workload.images_per_step))
        if residency == SWAP:
            t += self.reward_swap_seconds(dev)
        return t

    def reward_swap_seconds(self, dev: DeviceProfile) -> float:
        """Waking a reward model that shares the training devices and putting it back to sleep:
        its weights (split over its tensor-parallel devices) over the host link, both ways."""
        weights = 2.0 * self.reward.params / max(1, self.reward.tp) if self.reward is not None else 0.0
        return 2.0 * self.system.engine_wake_s + 2.0 * weights / (dev.host_link_gbps * GB)

    def _pass_seconds(self, compute: float, comm: float) -> float:
        return compute + self._exposed_comm(compute, comm)

    def _exposed_comm(self, compute: float, comm: float) -> float:
        """The part of a call's collectives ``comm`` that its ``compute`` does not hide."""
        return max(0.0, comm - self.system.comm_overlap * compute)

    def train_pass_seconds(self, samples: int, dev: DeviceProfile, group: TrainGroup, pool: str = "trainer",
                           checkpointing: bool | None = None) -> float:
        """One forward+backward pass of ``samples`` samples; ``checkpointing`` None: as decided
        for ``dev`` and ``pool`` (:meth:`checkpointing`)."""
        w = self.workload
        tokens = samples * w.cfg_factor * self.tokens()[1]
        if checkpointing is None:
            checkpointing = self.checkpointing(dev, group, pool)
        flops = self.train_flops(checkpointing)
        compute = dev.train_pass_overhead_s + samples * w.cfg_factor * flops / (
            dev.flops * self.efficiency(dev, tokens, train=True) * self.system.train_efficiency
        )
        return self._pass_seconds(compute, self.fsdp_comm_seconds(dev, group))

    def logprob_pass_seconds(self, samples: int, dev: DeviceProfile, group: TrainGroup) -> float:
        """A forward-only pass that recomputes the behaviour log-probs of one trained step."""
        w = self.workload
        tokens = samples * w.cfg_factor * self.tokens()[1]
        compute = dev.forward_overhead_s + samples * w.cfg_factor * self.forward_flops() / (
            dev.flops * self.efficiency(dev, tokens)
        )
        return self._pass_seconds(compute, self.fsdp_gather_seconds(dev, group))

    def train_seconds(self, images: int, dev: DeviceProfile, group: TrainGroup, trained_steps: int | None = None,
                      pool: str = "trainer", checkpointing: bool | None = None) -> float:
        """Training ``images`` samples on one rank of ``pool`` on ``dev``; ``checkpointing`` None:
        as decided for them (:meth:`checkpointing`), else that decision (a GAT rollout worker
        trains with the run's)."""
        k = self.workload.trained_steps if trained_steps is None else trained_steps
        key = (images, dev, group, k, pool, checkpointing)
        if key not in self._seconds_memo:
            self._seconds_memo[key] = self._train_seconds(images, dev, group, k, pool, checkpointing)
        return self._seconds_memo[key]

    def _train_seconds(self, images: int, dev: DeviceProfile, group: TrainGroup, k: int, pool: str,
                       checkpointing: bool | None = None) -> float:
        b = self.pass_batch(dev, group, pool)  # a pass that does not fit is reported by memory_problems
        t = k * sum(self.train_pass_seconds(n, dev, group, pool, checkpointing) for n in _passes(images, b))
        if self.system.recompute_logprob:
            bl = self.system.logprob_micro_batch or b
            t += k * sum(self.logprob_pass_seconds(n, dev, group) for n in _passes(images, bl))
        return t

    def optimizer_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """The step's optimizer work: one Adam update per PPO mini-batch, plus the system's
        per-step overhead (charged here: every training rank waits for it)."""
        s = self.system
        return self.workload.mini_batches * self.update_seconds(dev, group) + s.step_fixed_s + \
            self.state_stream_seconds(dev, group) + self.workload.optimizer_tasks * self.parked_round_trip_seconds(dev, group)

    def parked_round_trip_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """What one optimizer task of parked trainers adds: the state comes in for the step and
        goes back (0 when :meth:`optimizer_parked` says it stays resident)."""
        if not self.optimizer_parked(dev, group):
            return 0.0
        return 2.0 * self.optimizer_shard_bytes(group) / (dev.host_link_gbps * GB)

    def optimizer_task_seconds(self, dev: DeviceProfile, group: TrainGroup, mini_batch: int = 0) -> float:
        """One OPTIMIZER_STEP task of the plan, the step of mini-batch ``mini_batch``: its share of
        the updates (``mini_batches / optimizer_tasks``); the step's last task also pays the
        per-step overhead and the FSDP state stream, which the runtime does once per weights
        version (``workers/worker.py: DiffusionWorker.optimizer_step``). A step's tasks sum to
        :meth:`optimizer_seconds`."""
        w = self.workload
        t = w.mini_batches // w.optimizer_tasks * self.update_seconds(dev, group)
        t += self.parked_round_trip_seconds(dev, group)
        if mini_batch == w.optimizer_tasks - 1:
            t += self.system.step_fixed_s + self.state_stream_seconds(dev, group)
        return t

    def update_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """One Adam update of the local shard (+ the HSDP gradient all-reduce across replicas)."""
        s = self.system
        shard = self.trainable_params / group.shard
        # read + write fp32 master, m, v and the gradient of the local shard
        t = s.optimizer_fixed_s + 2.0 * (s.optimizer_bytes_per_param + s.grad_bytes_per_param) * shard / (dev.hbm_tbps * 1e12)
        if group.replicas > 1 and not group.hsdp_per_pass:  # HSDP: all-reduce the gradient shards across replicas once per update
            r = group.replicas
            t += 2.0 * (r - 1) / r * s.grad_bytes_per_param * shard / self.collective_bw(dev, 2)
        return t

    def state_stream_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """This runtime under FSDP with a weight-sync sender: after every optimizer step all ranks
        stream the full trained weights out of their shards together (``workers/fsdp.py:
        stream_full_state``, a collective), which rank 0 keeps for the weight sync; so the sync
        itself gathers nothing. Colocated, nothing per step: the state is gathered only when read
        (``DiffusionWorker.refresh_full_state``, once before the final weights are saved). An
        engine that always shards (veRL's) gathers at reload instead."""
        k = group.shard
        if k <= 1 or not group.sends or self.system.always_sharded:
            return 0.0
        return self.sync_bytes * (k - 1) / k / self.collective_bw(dev, group.shard_nodes)

    def snapshot_seconds(self, dev: DeviceProfile, cluster: Cluster) -> float:
        """Trainer 0 copies each new version into its reused, pinned host snapshot
        (``sync/snapshot.py: HostSnapshot``) on a side stream that the next step's work waits
        for: only the disaggregated sender, which sends from it on a side thread (a colocated
        run copies nothing per step). Under FSDP the copy of one bucket overlaps the gather of
        the next (``state_stream_seconds``), so the step pays the slower of the two: the copy
        beyond the stream. The optimizer step is a gang: every rank waits for it. An engine that
        always shards keeps no snapshot."""
        group = self.train_group(cluster)
        if self.system.always_sharded or not group.sends:
            return 0.0
        copy = self.sync_bytes / (dev.host_link_gbps * GB)
        if group.shard > 1 or self.workload.fsdp is True:
            return max(0.0, copy - self.state_stream_seconds(dev, group))
        return copy

    def pools_link_gbps(self, cluster: Cluster) -> float:
        """The link between the trainer and rollout pools, one direction, per device: NVLink
        only when every rollout worker shares trainer 0's node, else the network; the slower
        end's (what the weight sync and GAT's gradients cross)."""
        tp = cluster.placement("trainer")
        dev = self.device(tp.device)
        rollout = cluster.placement("rollout")
        ends = (dev, self.device(rollout.device))
        if tp.on_nodes is not None and rollout.on_nodes is not None:
            # the broadcast stays on NVLink only when every rollout worker shares trainer 0's node
            same_node = [i for i, n in enumerate(rollout.on_nodes) if n] == [tp.first_node]
        else:  # one node holds both pools only when they fit in it together
            same_node = tp.nodes == 1 and rollout.nodes == 1 and tp.size + rollout.size <= dev.devices_per_node
        return min(d.intra_node_gbps if same_node else d.inter_node_gbps for d in ends)

    def sync_seconds(self, cluster: Cluster) -> float:
        dev = self.device(cluster.placement("trainer").device)
        group = self.train_group(cluster)
        gather = 0.0
        if group.shard > 1 and self.system.always_sharded:  # trainer 0 gathers the shards for the sync
            gather = self.sync_bytes * (group.shard - 1) / group.shard / self.collective_bw(dev, group.shard_nodes)
        # (ours: every rank streamed them after the optimizer step, state_stream_seconds)
        link = self.pools_link_gbps(cluster)
        # a pipelined broadcast from trainer 0 costs about bytes / bandwidth whatever the number of
        # receivers; the sender is one device, so one NIC
        return self.system.sync_fixed_s + gather + self.sync_bytes / (link * GB * self.system.nccl_efficiency)

    def generation_gather_seconds(self, dev: DeviceProfile, cluster: Cluster, pool: str) -> float:
        """The FSDP all-gather of one generate forward on a worker of ``pool``: a worker that
        generates with its own sharded training module (a fused worker, or a TAG trainer, under
        FSDP; this runtime generates in place, ``engine_load_gbps`` 0) gathers every block's
        parameters for each transformer call and frees them after it (``workers/fsdp.py``: the
        frozen base of a LoRA run too), as the log-prob recomputation's forward does. A rollout
        worker holds the whole model; a separate rollout engine was given a gathered copy at
        reload (:meth:`reload_seconds`)."""
        if self.system.engine_load_gbps or pool not in ("fused", "trainer"):
            return 0.0
        return self.fsdp_gather_seconds(dev, self.train_group(cluster))

    def reload_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """Bringing the new weights to a worker's generation copy: gather the changed weights
        (the full model, or LoRA's factors: a frozen base does not change) from the FSDP shards,
        then copy them into the rollout engine when it is a separate one. A worker that generates
        in place with its sharded module (``engine_load_gbps`` 0) has no copy to refresh: it
        gathers at every forward instead (:meth:`generation_gather_seconds`)."""
        s = self.system
        if not s.engine_load_gbps:
            return 0.0
        changed = self.trainable_params
        k = group.shard
        gather = s.reload_bytes_per_param * changed * (k - 1) / k / self.collective_bw(dev, group.shard_nodes) if k > 1 else 0.0
        load = 2.0 * changed / (s.engine_load_gbps * GB) if s.engine_load_gbps else 0.0
        return gather + load

    def offload_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """One direction of the system's host offload per step: the optimizer state and the
        parameter shard (as many round trips as the system makes) over the host link."""
        s = self.system
        moved = self.optimizer_shard_bytes(group) if s.optimizer_offload else 0.0
        if s.param_offload:
            moved += s.param_offload_roundtrips * self.param_shard_bytes(group)
        return moved / (dev.host_link_gbps * GB)

    def switch_seconds(self, to_mode: str, dev: DeviceProfile, group: TrainGroup) -> float:
        """A worker turning from generating into training (or back)."""
        t = self.system.switch_fixed_s + self.offload_seconds(dev, group)
        if to_mode == MODE_GENERATE:
            t += self.reload_seconds(dev, group)
        return t

    def gat_gradient_bytes(self) -> float:
        """The LoRA gradients a GAT rollout worker sends to trainer 0 after a micro-batch (fp32)."""
        return self.held_grad_bytes_per_param() * self.trainable_params

    def gat_gradient_send_seconds(self, cluster: Cluster) -> float:
        """Sending one micro-batch's LoRA gradients from a rollout worker to trainer 0, over the
        link between the pools (:meth:`pools_link_gbps`, as the weight sync)."""
        return self.gat_gradient_bytes() / (self.pools_link_gbps(cluster) * GB * self.system.nccl_efficiency)

    def gat_train_seconds(self, images: int, dev: DeviceProfile, cluster: Cluster, trained_steps: int | None = None) -> float:
        """A GAT micro-batch on a rollout worker of device ``dev``: the passes a trainer would run
        on that device (one unsharded rank, the trainers' pass size), with the run's one
        checkpointing decision (the trainers', which counts the rollout workers' pass), then its
        gradients sent to trainer 0. The worker does nothing to switch (no offload, no reload):
        no switch is charged (:meth:`mode_of`)."""
        group = self.train_group(cluster)
        ckpt = self.run_checkpointing(cluster)
        # the rollout worker trains alone, unsharded, whatever the trainers' FSDP (no collectives)
        alone = replace(group, ranks=1, nodes=1, shard=1, shard_nodes=1)
        t = self.train_seconds(images, dev, alone, trained_steps, pool="trainer", checkpointing=ckpt)
        return t + self.gat_gradient_send_seconds(cluster)

    # ------------------------------------------------------------------ tasks

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

    def reward_residency(self, worker: WorkerId) -> str:
        return self.system.reward_residency if worker.pool == "fused" else RESIDENT

    def step_profile(self, dev: DeviceProfile, images: int) -> dict[str, Any]:
        """Per-denoising-step seconds of a generate call and its head and tail (what TSP's
        stage balancing measures on a real rollout worker)."""
        w = self.workload
        return {
            "step_s": [self.forward_seconds(images, dev)] * w.num_steps,
            "head_s": dev.generate_overhead_s + self.encode_seconds(math.ceil(images / w.group_size), dev),
            "tail_s": self.decode_seconds(images, dev),
        }

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

    # ------------------------------------------------------------------ planning and bounds

    def step_costs(self, spec: StrategySpec, cluster: Cluster) -> StepCosts:
        """Per-group costs the steady-state simulator decides TAG with before a step is measured
        (no switches; ``StepDriver(prior=...)``)."""
        G = spec.group_size
        gen_worker = spec.generators[0]
        gen_dev = self.device(cluster.device_of(gen_worker))
        tr_dev = self.device(cluster.device_of(spec.trainers[0]))
        group = self.train_group(cluster)
        return StepCosts(
            generate_per_group=self.generate_seconds(
                G * spec.groups_per_task, gen_dev, batch=self.rollout_batch(cluster, gen_worker.pool),
                gather_s=self.generation_gather_seconds(gen_dev, cluster, gen_worker.pool),
            ) / spec.groups_per_task,
            reward_per_group=self.reward_seconds(G, gen_dev, residency=self.reward_residency(gen_worker),
                                                 per_worker=self.images_per_worker(cluster, gen_worker.pool)),
            train_per_group=self.train_seconds(G * spec.train_micro_batch_groups, tr_dev, group,
                                               pool=spec.trainers[0].pool) / spec.train_micro_batch_groups,
            optimizer_step=self.optimizer_seconds(tr_dev, group),
            sync=self.sync_seconds(cluster) if spec.placement == "disaggregated" else 0.0,
        )

    def device_seconds_per_image(self, dev: DeviceProfile) -> dict[str, float]:
        """The least device time one image can take on ``dev``: its FLOPs at the device's best
        efficiency, without overheads, collectives, switches, recomputation or a judge's
        decoding tail (what the bound charges)."""
        w = self.workload
        generate = w.num_steps * w.cfg_factor * self.forward_flops() / (dev.flops * dev.mfu_forward)
        generate += self.encode_seconds(1, dev) / w.group_size + self.decode_seconds(1, dev)
        reward = self.reward_flops_per_image() / (dev.flops * dev.mfu_forward)
        best = max(self.bound_train_efficiency, self.system.train_efficiency)
        train = w.trained_steps * w.cfg_factor * self.train_flops(False) / (dev.flops * dev.mfu_train * best)
        return {"generate": generate, "reward": reward, "train": train}

    def zero_bubble_bound(self, devices: Iterable[str]) -> float:
        """Images/s no schedule on ``devices`` (one name per device) can beat.

        Every image must be generated, rewarded and trained; each phase may run on any device
        type, at that type's cost. The best split of the phases over the types is a small linear
        program (:func:`verl_digen.sim.bound.max_throughput`); with one type it is
        ``devices / device-seconds per image``."""
        counts = Counter(devices)
        if not counts:
            return 0.0
        return max_throughput(dict(counts), {n: self.device_seconds_per_image(self.device(n)) for n in counts})

    def usd_per_hour(self, cluster: Cluster) -> float:
        """What the cluster's devices rent for (``usd_per_hour`` of each device profile)."""
        return sum(p.size * self.device(p.device).usd_per_hour for p in cluster.pools.values())

    # ------------------------------------------------------------------ memory: what fits

    def reward_replica_bytes(self) -> float:
        """A whole replica's bf16 weights: a reward pool device holds one (the pool's replicas are
        one device each; a tensor-parallel replica over k devices has the same throughput as k of
        them, so the model charges the pool alike either way)."""
        return 2.0 * self.reward.params if self.reward is not None else 0.0

    def reward_weight_bytes(self) -> float:
        return 2.0 * self.reward.params / max(1, self.reward.tp) if self.reward is not None else 0.0

    def memory_problems(self, cluster: Cluster, *, trainers_generate: bool | None = None) -> list[str]:
        """Why this placement does not fit in device memory (empty: it fits): each pool whose
        role's per-GPU peak, as the memory planner computes it for :meth:`memory_job` (the run's
        own check, ``memory.plan.check_job_memory``), exceeds its device's memory, naming the pool,
        the peak phase, what it holds and the device. ``trainers_generate`` (TAG; None: the
        workload's ``tag``): trainers generate too.

        A served reward's pool is its inference server's devices, one bf16 replica each (not this
        runtime's workers, so not the memory planner's). Another system (``system.memory_planner``
        false) is estimated (:meth:`estimated_memory_problems`); a model without a family is not
        planned (nothing is reported)."""
        if trainers_generate is not None and trainers_generate != self.workload.tag:
            return self.with_workload(tag=trainers_generate).memory_problems(cluster)
        if not self.system.memory_planner:
            return self.estimated_memory_problems(cluster)
        problems = []
        if self.workload.gat and not self.workload.lora and "rollout" in cluster.pools:
            problems.append("rollout: GAT sends LoRA gradients to the trainers; a full fine-tune does not run it")
        r = self.reward
        if r is not None and r.served and "reward" in cluster.pools:
            p = cluster.placement("reward")
            dev = self.device(p.device)
            if self.reward_replica_bytes() > dev.hbm_gb * GIB:
                problems.append(f"reward: serving {r.name} holds a {self.reward_replica_bytes() / GIB:.1f} GiB bf16 replica "
                                f"per device, more than the {dev.hbm_gb:g} GiB of {p.device}")
        if not self.plans_memory:
            return problems
        job = self.memory_job(cluster)
        for plan in self.memory_plans(cluster):
            if plan.peak_gib > plan.device_gib:
                problems.append(_memory_problem(plan, job, ROLE_POOLS[plan.role], cluster, r.name if r else ""))
        return problems

    # ------------------------------------------------------------------ memory: another system's, estimated

    def estimated_memory_problems(self, cluster: Cluster) -> list[str]:
        """Another system's fit (``system.memory_planner`` false: not this runtime's workers, so
        not the memory planner's), estimated from profile bytes: a rollout or fused worker
        generating holds the bf16 weights, a resident reward model's share, and (fused) whatever
        training state its system does not offload; a reward pool device one replica of the reward
        model; trainers one pass (:meth:`training_bytes`), all within ``memory_headroom`` of the
        device."""
        problems = []
        s = self.system
        train_pool = training_pool(cluster)
        group = self.train_group(cluster)
        for pool, p in cluster.pools.items():
            dev = self.device(p.device)
            cap = dev.hbm_gb * GB * s.memory_headroom
            if pool in ("rollout", "fused"):
                held = self.param_bytes + (self.reward_weight_bytes() if self.reward_residency(WorkerId(pool, 0)) == RESIDENT else 0.0)
                if pool == "fused":
                    if not s.param_offload:
                        held += self.param_shard_bytes(group)
                    if not s.optimizer_offload:
                        held += (self.held_grad_bytes_per_param() + s.optimizer_bytes_per_param) * self.trainable_params / group.shard
                if held > cap:
                    problems.append(
                        f"{pool}: generating holds {held / GB:.0f} GB (weights {self.param_bytes / GB:.0f} GB"
                        f"{', training state' if pool == 'fused' else ''}{', reward model' if self.reward_weight_bytes() else ''})"
                        f", more than {cap / GB:.0f} GB on {dev.name}"
                    )
            if pool == "reward" and self.reward_replica_bytes() > cap:
                problems.append(
                    f"reward: a replica of {self.reward.name} per device holds {self.reward_replica_bytes() / GB:.0f} GB "
                    f"of weights, more than {cap / GB:.0f} GB on {dev.name}"
                )
            if pool == "trainer" and self.workload.tag and self.param_bytes + self.state_bytes_per_rank(group) > cap:
                problems.append(
                    f"trainer: generating (TAG) needs the full {self.param_bytes / GB:.0f} GB of weights next to "
                    f"{self.state_bytes_per_rank(group) / GB:.0f} GB of training state on {dev.name}"
                )
            if pool == train_pool:
                need = self.training_bytes(dev, group, pool, self.checkpointing(dev, group, pool))
                if need > cap:
                    state = self.state_bytes_per_rank(group)
                    problems.append(
                        f"{pool}: {state / GB:.0f} GB of training state per rank "
                        f"({f'{group.shard}-way sharded' if group.shard > 1 else 'unsharded'}) + "
                        f"{(need - state) / GB:.0f} GB of activations for a pass of {self.pass_batch(dev, group, pool)} "
                        f"sample(s){' and a resident reward model' if self.resident_reward_bytes(pool) else ''} "
                        f"exceed {cap / GB:.0f} GB on {dev.name}"
                    )
        return problems

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
