"""Where the workers of each pool go on the nodes of a cluster: one pure rule that the runtime
(:func:`verl_digen.placement.pools.assign_nodes`, on the Ray cluster's nodes) and the planner and
cost model (:func:`node_counts`, on a declared cluster) share, so the simulator costs the
placement the runtime makes. Below every layer (it imports nothing of verl_digen): the
simulator may read it without reaching up into the config and placement layers.
"""

from __future__ import annotations

from dataclasses import dataclass


class PlacementError(ValueError):
    """The pools do not fit on the nodes (the runtime reports it as a ``ConfigError``)."""


@dataclass(frozen=True)
class RayNode:
    """One node of the Ray cluster: its id and how many devices (GPUs, or CPU slots) it offers."""

    node_id: str
    devices: int


def pack_pools(pool_sizes: dict[str, int], nodes: list[RayNode], per_node: int | None) -> dict[str, list[str]]:
    """The node of every worker of every pool: ``{pool: [node_id of rank 0, rank 1, ...]}``.

    ``pool_sizes``: workers per pool; the ``trainer`` (or ``fused``) pool is placed first, on as
    few nodes as possible (fill one node, then the next), so that its collectives stay on a
    node's fast links where they can; the other pools, in the order given, go one worker at a
    time to the node with the most free devices (ties: the earlier node). Each node offers
    ``per_node`` devices (``trainer.n_gpus_per_node``; None: what each node has).
    """
    free = {n.node_id: n.devices if per_node is None else per_node for n in nodes}
    order = [n.node_id for n in nodes]
    total = sum(pool_sizes.values())
    if total > sum(free.values()):
        raise PlacementError(f"the pools need {total} devices but the nodes offer {sum(free.values())}")
    out: dict[str, list[str]] = {}
    packed = [p for p in ("trainer", "fused") if p in pool_sizes]
    for pool in packed + [p for p in pool_sizes if p not in packed]:
        ranks: list[str] = []
        for _ in range(pool_sizes[pool]):
            if pool in packed:  # fill the fullest-free node first, then keep filling it
                node = ranks[-1] if ranks and free[ranks[-1]] else max(order, key=lambda n: (free[n], -order.index(n)))
            else:
                node = max(order, key=lambda n: (free[n], -order.index(n)))
            free[node] -= 1
            ranks.append(node)
        out[pool] = ranks
    return out


def node_counts(pool_sizes: dict[str, int], per_node: int, nnodes: int) -> dict[str, tuple[int, ...]]:
    """Devices of every pool on each node of a cluster of ``nnodes`` x ``per_node`` devices, as
    :func:`pack_pools` places them: ``{pool: (on node 0, on node 1, ...)}``. The planner and the
    cost model read a pool's nodes from here, so they cost the placement the runtime makes."""
    nodes = [RayNode(str(i), per_node) for i in range(nnodes)]
    placed = pack_pools(pool_sizes, nodes, per_node)
    return {pool: tuple(ranks.count(n.node_id) for n in nodes) for pool, ranks in placed.items()}
