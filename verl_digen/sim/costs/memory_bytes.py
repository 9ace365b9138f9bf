"""What a training rank holds (its training state, a pass's activations), how many samples a pass
takes, and another system's fit estimated from those bytes (``system.memory_planner`` false).

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

import math

from verl_digen.schedule.plan import WorkerId
from verl_digen.sim.costs.cluster import Cluster, TrainGroup, training_pool
from verl_digen.sim.costs.profiles import GB, RESIDENT, DeviceProfile


class TrainingBytes:
    """A training rank's bytes and pass size; another system's memory, estimated."""

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

    def training_bytes(self, dev: DeviceProfile, group: TrainGroup, pool: str, checkpointing: bool,
                       parked: bool | None = None) -> float:
        """Peak bytes of one rank in a training pass: its training state (the optimizer's unless
        ``parked``; None: :meth:`optimizer_parked`), a resident reward model, and one pass's
        activations."""
        if parked is None:
            parked = self.optimizer_parked(dev, group, pool)
        return (self.state_bytes_per_rank(group, parked) + self.resident_reward_bytes(pool)
                + self.pass_batch(dev, group, pool) * self.activation_bytes_per_sample(checkpointing))

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
