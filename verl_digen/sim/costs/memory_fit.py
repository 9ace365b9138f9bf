"""Memory as the memory planner (:mod:`verl_digen.memory.plan`) decides it: the workload as its
job, each role's peak, what does not fit (the run's own check), activation checkpointing and
parked optimizer state.

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

from typing import Any

from verl_digen.sim.costs.cluster import Cluster, TrainGroup, _memoised, training_pool
from verl_digen.sim.costs.profiles import GB, GIB, DeviceProfile


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


class MemoryFit:
    """What fits, as the memory planner plans it, and the memory decisions of a run."""

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

    # ------------------------------------------------------------------ memory: what fits

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
