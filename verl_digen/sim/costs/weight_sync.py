"""The trained weights' ways: streamed out of the FSDP shards after an optimizer step, copied into
trainer 0's host snapshot, sent to the rollout pool (the weight sync), reloaded into a rollout
engine, offloaded to the host around a mode switch.

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

from verl_digen.sim.costs.cluster import Cluster, TrainGroup
from verl_digen.sim.costs.profiles import GB, DeviceProfile
from verl_digen.sim.costs.tasks import MODE_GENERATE


class WeightSync:
    """Weight streams, snapshots, syncs, reloads, offloads and mode switches."""

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
