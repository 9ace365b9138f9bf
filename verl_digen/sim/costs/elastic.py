"""The elastic mechanisms' costs: the per-group costs TAG (trainers generate) decides its share of a
step with before a step is measured (``schedule/elastic.py: tag_inputs_from_costs``), and GAT's
(rollout workers train) micro-batch on a rollout worker with its gradients' way to trainer 0.

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

from dataclasses import replace

from verl_digen.schedule.strategies import StepCosts, StrategySpec
from verl_digen.sim.costs.cluster import Cluster
from verl_digen.sim.costs.profiles import GB, DeviceProfile


class ElasticCosts:
    """TAG's per-group costs; GAT's micro-batches and gradients."""

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
