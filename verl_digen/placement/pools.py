"""Resource pools for the colocated and disaggregated placements.

colocated: one pool of ``n_gpus_per_node x nnodes`` devices, one fused worker per device.
disaggregated: a rollout pool, a trainer pool and an optional reward pool, each a veRL
``RayResourcePool`` of its own, optionally pinned to an accelerator type (heterogeneous
clusters: e.g. rollout on L40S, training on H800). On CPU machines a device is a CPU slot.

Everything is validated against the declared cluster (``trainer.n_gpus_per_node`` x
``trainer.nnodes``) before Ray is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_digen.config.schema import ConfigError, DigenConfig
from verl_digen.schedule.plan import WorkerId
from verl_digen.schedule.strategies import StrategySpec


@dataclass(frozen=True)
class ClusterSpec:
    n_devices_per_node: int
    nnodes: int

    @property
    def devices(self) -> int:
        return self.n_devices_per_node * self.nnodes


def cluster_from_trainer_config(trainer_cfg: Any) -> ClusterSpec:
    n = trainer_cfg.get("n_gpus_per_node")
    nodes = trainer_cfg.get("nnodes")
    for key, val in (("trainer.n_gpus_per_node", n), ("trainer.nnodes", nodes)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ConfigError(f"invalid config: {key}={val!r}; must be a positive integer")
    return ClusterSpec(n_devices_per_node=n, nnodes=nodes)


@dataclass(frozen=True)
class PoolLayout:
    """Per pool name: devices on each node, and an optional accelerator type."""

    pools: dict[str, tuple[list[int], str | None]]
    role_of_pool: dict[str, str]
    spec: StrategySpec


def pool_layout(cfg: DigenConfig, cluster: ClusterSpec) -> PoolLayout:
    b = cfg.batch
    common = dict(
        groups_per_step=b.groups_per_step,
        group_size=b.group_size,
        groups_per_task=b.groups_per_task,
        train_micro_batch_groups=b.train_micro_batch_groups,
        gap=cfg.gap.enable,
        max_staleness=cfg.async_.max_staleness,
    )
    if cfg.placement == "colocated":
        spec = StrategySpec(
            placement="colocated", rollout_workers=cluster.devices, trainer_workers=cluster.devices,
            num_steps=cfg.sampling.num_steps, **common,
        )
        return PoolLayout({"fused": ([cluster.n_devices_per_node] * cluster.nnodes, None)}, {"fused": "fused"}, spec)

    pools_cfg = cfg.pools
    total = 0
    pools: dict[str, tuple[list[int], str | None]] = {}
    for role in ("rollout", "trainer", "reward"):
        p = getattr(pools_cfg, role)
        if role == "reward" and p.devices == 0:
            continue
        if p.devices > cluster.n_devices_per_node:
            raise ConfigError(
                f"invalid config: digen.pools.{role}.devices={p.devices} exceeds "
                f"trainer.n_gpus_per_node={cluster.n_devices_per_node}"
            )
        if p.nodes > cluster.nnodes:
            raise ConfigError(f"invalid config: digen.pools.{role}.nodes={p.nodes} exceeds trainer.nnodes={cluster.nnodes}")
        total += p.world_size
        pools[role] = ([p.devices] * p.nodes, p.accelerator_type)
    if total > cluster.devices:
        raise ConfigError(
            f"invalid config: digen.pools need {total} devices "
            f"(rollout {pools_cfg.rollout.world_size} + trainer {pools_cfg.trainer.world_size} + "
            f"reward {pools_cfg.reward.world_size}) but the cluster has "
            f"trainer.n_gpus_per_node x trainer.nnodes = {cluster.devices}"
        )
    if b.groups_per_step % b.groups_per_task:
        raise ConfigError("invalid config: digen.batch.groups_per_task must divide digen.batch.groups_per_step")
    spec = StrategySpec(
        placement="disaggregated",
        rollout_workers=pools_cfg.rollout.world_size,
        trainer_workers=pools_cfg.trainer.world_size,
        reward_workers=pools_cfg.reward.world_size if pools_cfg.reward.devices else 0,
        tsp_stages=cfg.tsp.stages,
        num_steps=cfg.sampling.num_steps,
        train_split=cfg.tsp.train_split,
        tag=cfg.tag.enable,
        fsdp=cfg.fsdp.enable,
        **common,
    )
    return PoolLayout(pools, {name: name for name in pools}, spec)


def build_worker_groups(
    layout: PoolLayout,
    *,
    config: dict[str, Any],
    model_path: str,
    use_gpu: bool,
    num_threads: int,
) -> tuple[dict[str, Any], dict[WorkerId, Any]]:
    """Create one ``RayWorkerGroup`` per pool; return them and the actor of every WorkerId."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from verl_digen.workers.worker import DiffusionWorker

    groups: dict[str, Any] = {}
    actors: dict[WorkerId, Any] = {}
    remote_cls = ray.remote(DiffusionWorker)
    for pool_name, (process_on_nodes, accel) in layout.pools.items():
        pool = RayResourcePool(
            process_on_nodes=process_on_nodes,
            use_gpu=use_gpu,
            max_colocate_count=1,
            name_prefix=f"digen_{pool_name}_",
            accelerator_type=accel,
        )
        cls = RayClassWithInitArgs(
            remote_cls, role=layout.role_of_pool[pool_name], config=config, model_path=model_path, num_threads=num_threads
        )
        wg = RayWorkerGroup(pool, cls, name_prefix=f"digen_{pool_name}_", device_name="cuda" if use_gpu else "cpu")
        groups[pool_name] = wg
        for rank, actor in enumerate(wg.workers):
            actors[WorkerId(pool_name, rank)] = actor
    return groups, actors
