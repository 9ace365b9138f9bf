"""Where each pool sits (:class:`Cluster` of :class:`PoolPlacement`), and the training pool as FSDP
sees it (:class:`TrainGroup`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from verl_digen.schedule.plan import WorkerId
from verl_digen.schedule.strategies import StrategySpec

@dataclass(frozen=True)
class PoolPlacement:
    """A pool of ``size`` devices of one type spread over ``nodes`` nodes.

    ``on_nodes``: the pool's devices on each node of the cluster, by node index (0 where it has
    none), as the runtime places it (:func:`verl_digen.placement.pools.node_counts`): pools of
    any size, filling some nodes and part of another, sharing a node with another pool. None:
    ``size / nodes`` on each of ``nodes`` nodes of its own."""

    size: int
    nodes: int
    device: str
    on_nodes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.on_nodes is not None and (
            sum(self.on_nodes) != self.size or sum(1 for n in self.on_nodes if n) != self.nodes
        ):
            raise ValueError(f"pool of {self.size} devices on {self.nodes} nodes cannot be {self.on_nodes} per node")

    @classmethod
    def spread(cls, on_nodes: Iterable[int], device: str) -> "PoolPlacement":
        """The pool with ``on_nodes[i]`` devices on node ``i``."""
        counts = tuple(on_nodes)
        return cls(size=sum(counts), nodes=sum(1 for n in counts if n), device=device, on_nodes=counts)

    @property
    def node_devices(self) -> list[int]:
        """Devices on each node the pool spans, in node order (ranks fill them in that order)."""
        if self.on_nodes is not None:
            return [n for n in self.on_nodes if n]
        base, extra = divmod(self.size, max(1, self.nodes))
        return [base + (i < extra) for i in range(self.nodes)]

    def group_nodes(self, k: int) -> int:
        """The most nodes one group of ``k`` consecutive ranks spans (groups 0..k-1, k..2k-1, ...)."""
        node_of = [i for i, n in enumerate(self.node_devices) for _ in range(n)]
        return max(len(set(node_of[g:g + k])) for g in range(0, self.size, k)) if self.size else 1

    @property
    def first_node(self) -> int | None:
        """The node of rank 0 (None: a pool without ``on_nodes``)."""
        return next(i for i, n in enumerate(self.on_nodes) if n) if self.on_nodes is not None else None


@dataclass(frozen=True)
class Cluster:
    """Where each pool sits: its device type and how many nodes it spans."""

    pools: Mapping[str, PoolPlacement]

    def placement(self, pool: str) -> PoolPlacement:
        if pool not in self.pools:
            raise KeyError(f"pool {pool!r} is not in the cluster ({', '.join(self.pools)})")
        return self.pools[pool]

    def device_of(self, worker: WorkerId) -> str:
        return self.placement(worker.pool).device

    @property
    def devices(self) -> int:
        return sum(p.size for p in self.pools.values())

    @classmethod
    def for_spec(cls, spec: StrategySpec, device: str, devices_per_node: int = 8) -> "Cluster":
        """The pools on as few nodes of ``devices_per_node`` as hold them all, placed as the
        runtime places them (trainer packed first: it talks the most; the rest on what is left)."""
        from verl_digen.platform.nodes import node_counts

        sizes = {"fused": spec.rollout_workers} if spec.placement == "colocated" else {
            "rollout": spec.rollout_workers, "trainer": spec.trainer_workers}
        if spec.reward_workers:
            sizes["reward"] = spec.reward_workers
        nnodes = math.ceil(sum(sizes.values()) / devices_per_node)
        counts = node_counts(sizes, devices_per_node, nnodes)
        return cls({pool: PoolPlacement.spread(counts[pool], device) for pool in sizes})


def training_pool(cluster: Cluster) -> str:
    return "fused" if "fused" in cluster.pools else "trainer"


def _memoised(memo: dict, cluster: Cluster, make: Callable[[Cluster], Any]) -> Any:
    """``make(cluster)`` once per cluster: by the cluster object (the memo holds it, so its id is
    not reused while the model lives), else by an equal cluster's entry. The second finds what a
    pickled copy of the model computed before it was sent: an emulated worker gets the driver's
    memory decisions (seconds of meta-device tracing each) instead of making them again."""
    held = memo.get(id(cluster))
    if held is None or held[0] is not cluster:
        # by value: one dict lookup (a scan of every entry would grow with the planner's search)
        key = ("equal", tuple(sorted(cluster.pools.items())))
        if key not in memo:
            memo[key] = (cluster, make(cluster))
        held = memo[id(cluster)] = (cluster, memo[key][1])
    return held[1]


@dataclass(frozen=True)
class TrainGroup:
    """The training pool as FSDP sees it: ``ranks`` devices over ``nodes`` nodes; parameters
    are sharded over groups of ``shard`` ranks (``shard == ranks``: flat FSDP; fewer: HSDP,
    replicated ``ranks / shard`` times). ``sends``: the group has a weight-sync sender (a
    disaggregated run's trainer pool), so the runtime streams every version out of the shards.
    ``gat_device``: under GAT, the rollout pool's device (its workers train micro-batches too, with
    the run's one checkpointing decision); empty without GAT. ``checkpointing`` and
    ``optimizer_parked``: the memory planner's decisions for the cluster (:meth:`CostModel.memory_job`)."""

    ranks: int
    nodes: int
    shard: int
    shard_nodes: int
    sends: bool
    gat_device: str = ""
    # The run's memory decisions for this cluster, the memory planner's (CostModel.memory_job;
    # None / False where it plans nothing): activation checkpointing (None: not decided there) and
    # whether disaggregated trainers park their optimizer state on the host between steps.
    checkpointing: bool | None = None
    optimizer_parked: bool = False
    # HSDP as FSDP2 runs it (the system's fsdp_mesh=auto): the replicas all-reduce each pass's
    # gradient shards in its backward. False: once per optimizer step (hsdp_shard's systems).
    hsdp_per_pass: bool = False

    @property
    def replicas(self) -> int:
        return max(1, self.ranks // self.shard)
