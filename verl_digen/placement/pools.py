"""Resource pools for the colocated and disaggregated placements.

colocated: one pool of ``n_gpus_per_node x nnodes`` devices, one fused worker per device.
disaggregated: a rollout pool, a trainer pool and an optional reward pool, each a veRL
``RayResourcePool`` of its own, optionally pinned to an accelerator type (heterogeneous
clusters: e.g. rollout on L40S, training on H800). On CPU machines a device is a CPU slot.

Everything is validated against the declared cluster (``trainer.n_gpus_per_node`` x
``trainer.nnodes``) before Ray is touched; the rules live with the config
(``PoolsConfig.validate_cluster``) and the strategy (``strategy_violations``).

Then the declared cluster is checked against the Ray cluster the job runs on
(:func:`cluster_nodes`, :func:`check_cluster`), and every worker gets a node
(:func:`assign_nodes`): the trainer (or fused) pool packed on as few nodes as possible, since
its collectives prefer NVLink to the network; rollout and reward anywhere, spread over what is
left. Each worker's placement-group bundle is pinned to its node by Ray's ``ray.io/node-id``
label. A pool with an accelerator type (``digen.pools.<pool>.accelerator_type=L40S``) goes only
to nodes of that type: Ray names the type of a node by the resource ``accelerator_type:L40S``
(``ray._common.utils.RESOURCE_CONSTRAINT_PREFIX``; set for GPUs it detects, or declared with
``ray start --resources``), which every bundle of the pool also asks for; a type no node has is
refused here, naming the key and the types the cluster has, instead of a placement group
that waits forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from verl_digen.config.schema import ConfigError, DigenConfig
from verl_digen.config.verl_keys import VerlTrainerKeys
from verl_digen.platform.nodes import PlacementError, RayNode, node_counts, pack_pools  # noqa: F401 (re-exported)
from verl_digen.schedule.plan import WorkerId
from verl_digen.schedule.strategies import StrategySpec

NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node (ray.util.placement_group)
ACCELERATOR_PREFIX = "accelerator_type:"  # Ray's resource of a node's accelerator type (RESOURCE_CONSTRAINT_PREFIX)


def accelerator_name(value: str) -> str:
    """The accelerator type a user wrote, without Ray's resource prefix (``L40S`` either way)."""
    return value[len(ACCELERATOR_PREFIX):] if value.startswith(ACCELERATOR_PREFIX) else value


def accelerator_resource(accelerator_type: str) -> str:
    """Ray's resource name of an accelerator type: ``accelerator_type:L40S``."""
    return ACCELERATOR_PREFIX + accelerator_name(accelerator_type)


# PyTorch's caching allocator with expandable segments grows one mapping per stream instead of
# reserving fixed-size segments, so memory freed by one phase (a decode's feature maps) is
# reusable by the next (a training pass's activations) without the cached-but-unusable gaps that
# make ``memory_reserved`` exceed ``memory_allocated`` by gigabytes on long runs (PyTorch docs,
# "CUDA semantics: Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"). The memory plan's
# reserve allowance (memory/plan.py: RESERVE_FRACTION) assumes it.
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def allocator_conf(user_conf: str | None) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` for a worker: the user's own entries kept, ours appended. A
    user who names ``expandable_segments`` (either way) keeps their choice, and the
    ``cudaMallocAsync`` backend has no expandable segments (the option belongs to the native
    allocator): then the user's value as it is."""
    entries = [e.strip() for e in (user_conf or "").split(",") if e.strip()]
    keys = {e.split(":", 1)[0].strip() for e in entries}
    if "expandable_segments" in keys or any(e.replace(" ", "") == "backend:cudaMallocAsync" for e in entries):
        return ",".join(entries)
    return ",".join(entries + [EXPANDABLE_SEGMENTS])


def worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables every worker process starts with (``RayWorkerGroup``'s
    ``worker_env``): the allocator configuration, read at the process's first CUDA allocation,
    so it must be in the environment before the worker starts, not set by the worker.
    ``environ``: the driver's environment (default ``os.environ``), whose
    ``PYTORCH_CUDA_ALLOC_CONF`` the user may have set."""
    environ = os.environ if environ is None else environ
    return {"PYTORCH_CUDA_ALLOC_CONF": allocator_conf(environ.get("PYTORCH_CUDA_ALLOC_CONF"))}


@dataclass(frozen=True)
class ClusterSpec:
    n_devices_per_node: int
    nnodes: int

    @property
    def devices(self) -> int:
        return self.n_devices_per_node * self.nnodes


def cluster_from_trainer_keys(trainer: VerlTrainerKeys) -> ClusterSpec:
    """The declared cluster: ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` (checked positive
    when the keys were read)."""
    return ClusterSpec(n_devices_per_node=trainer.n_gpus_per_node, nnodes=trainer.nnodes)


def cluster_nodes(nodes: list[dict[str, Any]], device_kind: str) -> list[RayNode]:
    """The alive nodes of ``ray.nodes()`` with their device counts, in Ray's order.

    ``device_kind``: ``"cuda"`` counts GPUs, ``"cpu"`` counts logical CPUs (a CPU slot is a
    device on a CPU-only cluster).
    """
    resource = "GPU" if device_kind == "cuda" else "CPU"
    return [RayNode(n["NodeID"], int(n.get("Resources", {}).get(resource, 0)), _accelerator_types(n.get("Resources", {})))
            for n in nodes if n.get("Alive")]


def _accelerator_types(resources: dict[str, float]) -> frozenset[str]:
    return frozenset(accelerator_name(k) for k, v in resources.items() if k.startswith(ACCELERATOR_PREFIX) and v > 0)


def check_cluster(nodes: list[RayNode], cluster: ClusterSpec, device_kind: str,
                  wanted_types: frozenset[str] = frozenset()) -> list[RayNode]:
    """The ``cluster.nnodes`` nodes the job uses, each offering ``n_devices_per_node`` devices.

    Raises ``ConfigError`` naming ``trainer.nnodes`` / ``trainer.n_gpus_per_node`` and what the
    Ray cluster has when it cannot give them. Nodes of an accelerator type in ``wanted_types``
    (the pools' ``accelerator_type``) come first, then those with the most devices (the head
    node first among equals, as Ray lists it).
    """
    unit = "GPUs" if device_kind == "cuda" else "CPU slots"
    big_enough = [n for n in nodes if n.devices >= cluster.n_devices_per_node]
    if len(big_enough) < cluster.nnodes:
        offered = ", ".join(f"{n.node_id[:8]}: {n.devices}" for n in nodes) or "no alive node"
        raise ConfigError(
            f"invalid config: trainer.nnodes={cluster.nnodes} x trainer.n_gpus_per_node={cluster.n_devices_per_node} "
            f"needs {cluster.nnodes} node(s) with at least {cluster.n_devices_per_node} {unit} each, but the Ray "
            f"cluster has {len(big_enough)} such node(s) ({unit} per node: {offered}); add nodes with "
            "`ray start --address=<head>:<port>` or lower trainer.nnodes / trainer.n_gpus_per_node"
        )
    order = sorted(range(len(big_enough)),
                   key=lambda i: (not big_enough[i].accelerator_types & wanted_types, -big_enough[i].devices, i))
    return [big_enough[i] for i in order[: cluster.nnodes]]


def assign_nodes(pool_sizes: dict[str, int], nodes: list[RayNode], per_node: int | None,
                 pool_types: dict[str, str | None] | None = None) -> dict[str, list[str]]:
    """The node of every worker of every pool (:func:`verl_digen.platform.nodes.pack_pools`: the
    trainer or fused pool packed on as few nodes as possible, the others spread over what is
    left; a pool with an accelerator type in ``pool_types`` only on nodes of that type);
    ``ConfigError`` when the pools need more devices than the nodes offer, or a type no node has."""
    types = {p: accelerator_name(t) for p, t in (pool_types or {}).items() if t}
    check_accelerator_types(types, nodes)
    try:
        return pack_pools(pool_sizes, nodes, per_node, types)
    except PlacementError as e:
        raise ConfigError(f"invalid config: {e}") from None


def check_accelerator_types(pool_types: dict[str, str | None], nodes: list[RayNode]) -> None:
    """``ConfigError`` naming ``digen.pools.<pool>.accelerator_type`` and the types the nodes have
    when no node has a pool's type (Ray would wait for it forever)."""
    have = sorted(set().union(*(n.accelerator_types for n in nodes)))
    for pool, wanted in pool_types.items():
        if wanted and not any(accelerator_name(wanted) in n.accelerator_types for n in nodes):
            raise ConfigError(
                f"invalid config: digen.pools.{pool}.accelerator_type={wanted!r}; no node of the Ray cluster has "
                f"the resource {accelerator_resource(wanted)!r}. Accelerator types of its nodes: "
                f"{', '.join(have) or 'none'} (Ray detects a GPU's type, or `ray start --resources "
                f"'{{\"{accelerator_resource(wanted)}\": 1}}'` declares one)"
            )


@dataclass(frozen=True)
class PoolLayout:
    """Per pool name: devices on each node of the declared cluster (0 where the pool has
    none), and an optional accelerator type."""

    pools: dict[str, tuple[list[int], str | None]]
    role_of_pool: dict[str, str]
    spec: StrategySpec

    @property
    def worker_counts(self) -> dict[str, int]:
        """Workers per pool name, over all its nodes."""
        return {name: sum(counts) for name, (counts, _accel) in self.pools.items()}

    @property
    def accelerator_types(self) -> dict[str, str | None]:
        """The accelerator type each pool asks for (None: any)."""
        return {name: accel for name, (_counts, accel) in self.pools.items()}


def pool_layout(cfg: DigenConfig, cluster: ClusterSpec) -> PoolLayout:
    # The strategy fields the config fixes (the same mapping DigenConfig.validate checks).
    common = dict(cfg.strategy_fields(), group_size=cfg.batch.group_size, gap=cfg.gap.enable)
    if cfg.placement == "colocated":
        spec = StrategySpec(**dict(common, rollout_workers=cluster.devices), trainer_workers=cluster.devices)
        cfg.fsdp.check_layout([cluster.n_devices_per_node] * cluster.nnodes)
        return PoolLayout({"fused": ([cluster.n_devices_per_node] * cluster.nnodes, None)}, {"fused": "fused"}, spec)

    pools_cfg = cfg.pools
    pools_cfg.validate_cluster("digen.pools", cluster.n_devices_per_node, cluster.nnodes)
    roles = [r for r in ("rollout", "trainer", "reward") if r != "reward" or pools_cfg.reward.devices]
    counts = node_counts({r: getattr(pools_cfg, r).world_size for r in roles}, cluster.n_devices_per_node, cluster.nnodes)
    types = {r: getattr(pools_cfg, r).accelerator_type for r in roles}
    pools = {r: (list(counts[r]), accelerator_name(types[r]) if types[r] else None) for r in roles}
    cfg.fsdp.check_layout(list(counts["trainer"]))
    spec = StrategySpec(
        **common,
        trainer_workers=pools_cfg.trainer.world_size,
        reward_workers=pools_cfg.reward.world_size if pools_cfg.reward.devices else 0,
    )
    return PoolLayout(pools, {name: name for name in pools}, spec)


def build_worker_groups(
    layout: PoolLayout,
    *,
    config: DigenConfig,
    model_path: str,
    use_gpu: bool,
    num_threads: int,
    placement: dict[str, list[str]] | None = None,
) -> tuple[dict[str, Any], dict[WorkerId, Any]]:
    """Create one ``RayWorkerGroup`` per pool; return them and the actor of every WorkerId.

    ``placement``: the node of every worker (:func:`assign_nodes`; None: over the live nodes'
    own devices, for callers that declare no cluster). Each pool gets one
    placement group whose bundle ``r`` is pinned to rank ``r``'s node; veRL's resource pool
    takes it as its own (it creates placement groups only when it has none), so veRL still
    sets ranks, the master address and the device of every worker.
    """
    import ray
    from ray.util.placement_group import placement_group
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from verl_digen.workers.worker import DiffusionWorker

    if placement is None:
        nodes = cluster_nodes(ray.nodes(), "cuda" if use_gpu else "cpu")
        placement = assign_nodes(layout.worker_counts, nodes, None, layout.accelerator_types)
    groups: dict[str, Any] = {}
    actors: dict[WorkerId, Any] = {}
    remote_cls = ray.remote(DiffusionWorker)
    for pool_name, (process_on_nodes, accel) in layout.pools.items():
        nodes = placement[pool_name]
        if len(nodes) != sum(process_on_nodes):
            raise ValueError(f"pool {pool_name}: {sum(process_on_nodes)} workers but {len(nodes)} placed")
        bundle: dict[str, float] = {"CPU": 1}
        if use_gpu:
            bundle["GPU"] = 1
        if accel is not None:  # a sliver of the node's type resource, as veRL's RayResourcePool asks
            bundle[accelerator_resource(accel)] = 1e-4
        pg = placement_group(
            [dict(bundle) for _ in nodes], strategy="PACK", name=f"digen_{pool_name}_pg",
            bundle_label_selector=[{NODE_ID_LABEL: n} for n in nodes],
        )
        _wait_ready(pg, pool_name, bundle, nodes, config.task_timeout_s)
        pool = RayResourcePool(
            process_on_nodes=[len(nodes)],
            use_gpu=use_gpu,
            max_colocate_count=1,
            name_prefix=f"digen_{pool_name}_",
            accelerator_type=accelerator_resource(accel) if accel else None,  # unused: the pool takes our pg
        )
        pool.pgs = [pg]
        cls = RayClassWithInitArgs(
            remote_cls, role=layout.role_of_pool[pool_name], config=config, model_path=model_path, num_threads=num_threads
        )
        if use_gpu:
            # The driver may sit on a node without GPUs, where veRL's platform would ask for none.
            cls.update_options({"num_gpus": 1})
        wg = RayWorkerGroup(pool, cls, name_prefix=f"digen_{pool_name}_", device_name="cuda" if use_gpu else "cpu",
                            worker_env=worker_env())
        groups[pool_name] = wg
        for rank, actor in enumerate(wg.workers):
            actors[WorkerId(pool_name, rank)] = actor
    return groups, actors


def _wait_ready(pg: Any, pool_name: str, bundle: dict[str, float], nodes: list[str], timeout_s: float) -> None:
    """Wait for a pool's placement group; on timeout say what it waited for (not a bare timeout)."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise TimeoutError(
            f"the {pool_name} pool's placement group was not ready after {timeout_s:g} s (digen.task_timeout_s): "
            f"{len(nodes)} bundle(s) of {bundle} on node(s) {sorted(set(n[:8] for n in nodes))}; `ray status` shows "
            "what the cluster has free (another job holding the devices, or a resource no node offers)"
        ) from None
