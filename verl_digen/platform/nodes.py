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
    """One node of the Ray cluster: its id, how many devices (GPUs, or CPU slots) it offers,
    and its accelerator types (Ray's ``accelerator_type:<type>`` resources, e.g. ``L40S``)."""

    node_id: str
    devices: int
    accelerator_types: frozenset[str] = frozenset()


def pack_pools(
    pool_sizes: dict[str, int], nodes: list[RayNode], per_node: int | None, pool_types: dict[str, str | None] | None = None
) -> dict[str, list[str]]:
    """The node of every worker of every pool: ``{pool: [node_id of rank 0, rank 1, ...]}``.

    ``pool_sizes``: workers per pool; the ``trainer`` (or ``fused``) pool is placed first, on as
    few nodes as possible (fill one node, then the next), so that its collectives stay on a
    node's fast links where they can; the other pools, in the order given, go one worker at a
    time to the node with the most free devices (ties: the earlier node). Each node offers
    ``per_node`` devices (``trainer.n_gpus_per_node``; None: what each node has).
    ``pool_types``: a pool's accelerator type, when it asks for one: its workers go only to
    nodes of that type, and the typed pools are placed before the others (their choice is the
    narrower one).
    """
    free = {n.node_id: n.devices if per_node is None else per_node for n in nodes}
    order = [n.node_id for n in nodes]
    total = sum(pool_sizes.values())
    if total > sum(free.values()):
        raise PlacementError(f"the pools need {total} devices but the nodes offer {sum(free.values())}")
    types = {p: t for p, t in (pool_types or {}).items() if t}
    out: dict[str, list[str]] = {}
    packed = [p for p in ("trainer", "fused") if p in pool_sizes]
    pools = packed + [p for p in pool_sizes if p not in packed]
    for pool in [p for p in pools if p in types] + [p for p in pools if p not in types]:
        allowed = [n.node_id for n in nodes if pool not in types or types[pool] in n.accelerator_types]
        out[pool] = _place_pool(pool, pool_sizes[pool], allowed, free, order, packed=pool in packed, kind=types.get(pool))
    return out


def _place_pool(pool: str, size: int, allowed: list[str], free: dict[str, int], order: list[str], *,
                packed: bool, kind: str | None) -> list[str]:
    """One pool's ranks on the ``allowed`` nodes (taking their ``free`` devices): packed (fill
    the fullest-free node, then keep filling it) or spread (each to the node with most free)."""
    ranks: list[str] = []
    offered = sum(free[n] for n in allowed)
    for _ in range(size):
        if not any(free[n] for n in allowed):
            if kind:
                raise PlacementError(f"digen.pools.{pool}.accelerator_type={kind!r}: the {pool} pool needs {size} "
                                     f"devices of that type but its nodes have {offered} free")
            raise PlacementError(f"the {pool} pool needs {size} devices but its nodes have {offered} free")
        if packed and ranks and free[ranks[-1]]:
            node = ranks[-1]
        else:
            node = max(allowed, key=lambda n: (free[n], -order.index(n)))
        free[node] -= 1
        ranks.append(node)
    return ranks


def node_counts(pool_sizes: dict[str, int], per_node: int, nnodes: int) -> dict[str, tuple[int, ...]]:
    """Devices of every pool on each node of a cluster of ``nnodes`` x ``per_node`` devices, as
    :func:`pack_pools` places them: ``{pool: (on node 0, on node 1, ...)}``. The planner and the
    cost model read a pool's nodes from here, so they cost the placement the runtime makes."""
    nodes = [RayNode(str(i), per_node) for i in range(nnodes)]
    placed = pack_pools(pool_sizes, nodes, per_node)
    return {pool: tuple(ranks.count(n.node_id) for n in nodes) for pool, ranks in placed.items()}
