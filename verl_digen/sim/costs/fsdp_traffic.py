"""The training pool as FSDP sees it (:class:`~.cluster.TrainGroup` of a cluster, with the memory
planner's decisions) and what its collectives move and cost: a training pass's all-gathers,
reduce-scatters and HSDP all-reduces, a forward's all-gather (log-probs, generating in place).

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

from dataclasses import replace

from verl_digen.sim.costs.cluster import Cluster, TrainGroup, _memoised, training_pool
from verl_digen.sim.costs.profiles import GB, DeviceProfile


class FsdpTraffic:
    """The training group of a cluster and its FSDP collectives."""

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

    # ------------------------------------------------------------------ collectives

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
