"""How the training ranks are laid out for FSDP2 and in which dtype gradients are reduced: one
decision that the workers build (:mod:`verl_digen.workers.fsdp`: the ``DeviceMesh`` and the
``MixedPrecisionPolicy``), the cost model charges in seconds (bytes each rank moves per pass)
and the memory planner charges in bytes (the reduce buffers). No torch here: config readers,
the planner and emulated workers import it.

Flat FSDP shards every parameter over all ``N`` ranks: a pass's gradient reduce-scatter is one
ring over every rank, so with ranks on several nodes every byte of it crosses the slowest link
(``(N-1)/N`` of the trained parameters' gradients per rank). HSDP (``digen.fsdp.mesh=hsdp``)
shards over the ``k`` ranks of one node and replicates across the ``r`` nodes: the
reduce-scatter stays inside the node (NVLink) and only each rank's shard, ``1/k`` of the
gradients, is all-reduced across nodes; the all-gathers of the forward and backward stay inside
the node too. The price: each rank holds ``1/k`` of the training state instead of ``1/N``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from verl_digen.config.errors import ConfigError

MESH_MODES = ("auto", "flat", "hsdp")
REDUCE_DTYPES = ("auto", "fp32", "bf16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# FSDP2's mesh dimension names of a 2-D (HSDP) mesh: replicas across nodes, shards within one.
MESH_DIM_NAMES = ("replicate", "shard")


class LayoutError(ConfigError):
    """A ``digen.fsdp`` layout the training ranks' placement or the run cannot give; names the key."""


@dataclass(frozen=True)
class FsdpLayout:
    """The training ranks as FSDP2 groups them: ``rows[i]`` are the ranks of replica ``i`` (one
    node's ranks under HSDP; one row of every rank when flat), over which parameters, gradients
    and optimizer state are sharded; ``reduce_dtype``: ``"fp32"`` or ``"bf16"``."""

    rows: tuple[tuple[int, ...], ...]
    reduce_dtype: str

    @property
    def replicas(self) -> int:
        return len(self.rows)

    @property
    def shard(self) -> int:
        return len(self.rows[0])

    @property
    def hsdp(self) -> bool:
        return self.replicas > 1

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype]


def ranks_by_node(node_of_rank: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The ranks on each node, nodes in the order of their lowest rank: ``["a", "b", "a", "b"]``
    gives ``((0, 2), (1, 3))`` (Ray does not promise that a pool's ranks fill nodes in order)."""
    table: dict[str, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        table.setdefault(node, []).append(rank)
    return tuple(tuple(ranks) for ranks in table.values())


def mesh_shape(node_ranks: Sequence[int], mode: str) -> tuple[int, int]:
    """``(replicas, shard)`` of the training ranks, ``node_ranks[i]`` of them on node ``i``.

    ``auto``: HSDP (one replica per node, shards within it) exactly when the ranks span more than
    one node with the same number on each (HSDP needs equal shard groups; uneven nodes stay flat);
    ``flat``: ``(1, N)``; ``hsdp``: as auto, but an error where HSDP cannot be built."""
    if mode not in MESH_MODES:
        raise LayoutError(f"invalid config: digen.fsdp.mesh={mode!r}; valid: {', '.join(MESH_MODES)}")
    counts = [n for n in node_ranks if n]
    total = sum(counts)
    even = len(set(counts)) == 1
    if mode == "flat" or (mode == "auto" and (len(counts) < 2 or not even)):
        return 1, total
    if len(counts) < 2:
        raise LayoutError(
            f"invalid config: digen.fsdp.mesh=hsdp but the {total} training ranks sit on one node: HSDP replicates "
            "across nodes and shards within one. Use digen.fsdp.mesh=auto (flat on one node) or flat"
        )
    if not even:
        raise LayoutError(
            f"invalid config: digen.fsdp.mesh=hsdp but the training ranks sit {counts} per node: HSDP needs the "
            "same number on every node (one shard group each). Give the pool whole nodes "
            "(digen.pools.trainer.devices per node with digen.pools.trainer.nodes), or use digen.fsdp.mesh=auto or flat"
        )
    return len(counts), counts[0]


def reduce_dtype(setting: str, *, lora: bool, weights_dtype: str) -> str:
    """The dtype of the gradient reduction: ``"fp32"`` or ``"bf16"``.

    ``auto``: bf16 for a full fine-tune whose weights are bf16, fp32 otherwise. There autograd
    already writes each rank's gradient in bf16 and FSDP2 hands the reduced shard back in the
    parameter's dtype (bf16), so an fp32 reduction only keeps the partial sums of the ring in fp32:
    a bf16 one rounds each partial sum (``N - 1`` roundings of relative 2**-9 instead of one),
    halves the bytes, and what the masters accumulate over micro-batches and steps stays fp32
    (``MasterWeights``). LoRA's factors train in fp32 and their gradients are megabytes: fp32.
    ``bf16`` with LoRA is refused (it would round fp32 gradients to save nothing measurable)."""
    if setting not in REDUCE_DTYPES:
        raise LayoutError(f"invalid config: digen.fsdp.reduce_dtype={setting!r}; valid: {', '.join(REDUCE_DTYPES)}")
    if setting == "bf16" and lora:
        raise LayoutError(
            "invalid config: digen.fsdp.reduce_dtype=bf16 with digen.model.lora.enable=true: LoRA's factors train in "
            "fp32 and their gradients are megabytes, a bf16 reduction would round them for no measurable saving. "
            "Use digen.fsdp.reduce_dtype=auto or fp32"
        )
    if setting == "auto":
        return "bf16" if (weights_dtype == "bf16" and not lora) else "fp32"
    return setting


def choose_layout(node_of_rank: Sequence[str], *, mesh: str, reduce: str, lora: bool,
                  weights_dtype: str) -> FsdpLayout:
    """The layout a trainer group builds from where its ranks run (``node_of_rank[r]``: rank
    ``r``'s node) and the ``digen.fsdp`` settings."""
    table = ranks_by_node(node_of_rank)
    replicas, _shard = mesh_shape([len(r) for r in table], mesh)
    rows = table if replicas > 1 else (tuple(range(len(node_of_rank))),)
    return FsdpLayout(rows=rows, reduce_dtype=reduce_dtype(reduce, lora=lora, weights_dtype=weights_dtype))


@dataclass(frozen=True)
class ReduceTraffic:
    """Bytes one rank sends for one pass's gradient reduction (ring collectives, one direction):
    ``reduce_scatter`` over its shard group (inside a node under HSDP; across every node when a
    flat mesh spans several), then ``all_reduce`` of its shard across the replicas (HSDP only,
    over the network)."""

    reduce_scatter: float
    all_reduce: float


def reduce_traffic(trained_params: float, *, replicas: int, shard: int, reduce_bytes: int) -> ReduceTraffic:
    """What FSDP2's ``foreach_reduce`` moves per pass for ``trained_params`` gradients: a ring
    reduce-scatter of the whole gradient over ``shard`` ranks sends ``(k-1)/k`` of it from each
    rank; a ring all-reduce of the ``1/k`` shard over ``replicas`` ranks sends ``2 (r-1)/r`` of
    the shard."""
    grads = float(trained_params) * reduce_bytes
    rs = grads * (shard - 1) / shard if shard > 1 else 0.0
    ar = 2.0 * (replicas - 1) / replicas * grads / shard if replicas > 1 else 0.0
    return ReduceTraffic(reduce_scatter=rs, all_reduce=ar)


def reduce_buffer_bytes(unit_trained_params: float, *, replicas: int, shard: int, reduce_bytes: int) -> float:
    """Device bytes of one FSDP unit's gradient reduction beyond the gradients themselves: the
    reduce-scatter input (the unit's whole gradient, copied in the reduce dtype) and its output
    (the ``1/k`` shard in the reduce dtype, which HSDP all-reduces in place and FSDP2 keeps until
    the next unit's reduction). Flat FSDP on one rank reduces nothing."""
    if shard * replicas <= 1:
        return 0.0
    return float(unit_trained_params) * reduce_bytes * (1.0 + 1.0 / shard)
