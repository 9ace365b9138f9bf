"""Resource pools for the colocated and disaggregated placements.

colocated: one pool of ``n_gpus_per_node x nnodes`` devices, one fused worker per device.
disaggregated: a rollout pool, a trainer pool and an optional reward pool, each a veRL
``RayResourcePool`` of its own, optionally pinned to an accelerator type (heterogeneous
clusters: e.g. rollout on L40S, training on H800). On CPU machines a device is a CPU slot.

Everything is validated against the declared cluster (``trainer.n_gpus_per_node`` x
``trainer.nnodes``) before Ray is touched; the rules live with the config
(``PoolsConfig.validate_cluster``) and the strategy (``strategy_violations``).
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
    # The strategy fields the config fixes (the same mapping DigenConfig.validate checks).
    common = dict(cfg.strategy_fields(), group_size=cfg.batch.group_size, gap=cfg.gap.enable)
    if cfg.placement == "colocated":
        spec = StrategySpec(**dict(common, rollout_workers=cluster.devices), trainer_workers=cluster.devices)
        return PoolLayout({"fused": ([cluster.n_devices_per_node] * cluster.nnodes, None)}, {"fused": "fused"}, spec)

    pools_cfg = cfg.pools
    pools_cfg.validate_cluster("digen.pools", cluster.n_devices_per_node, cluster.nnodes)
    pools: dict[str, tuple[list[int], str | None]] = {}
    for role in ("rollout", "trainer", "reward"):
        p = getattr(pools_cfg, role)
        if role == "reward" and p.devices == 0:
            continue
        pools[role] = ([p.devices] * p.nodes, p.accelerator_type)
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
