"""``python -m verl_digen.sim.planner``: recommend a pool split and mechanisms for a cluster.

The planner enumerates configurations (colocated; every disaggregated pool split, placed on
the nodes as the runtime places it: pools may fill part of a node and share it; micro-batch
sizes; GAP and TCSS on or off; a reward pool of its own for a reward model with weights, where
the system places one), drops the ones that do
not fit in device memory, simulates each with the cost model (the same plans the Ray
executor would run) and ranks them by images/s. It prints the ranked table, the zero-bubble
bound and the cost per 1,000 images next to every row, and the hydra overrides that run the
best configuration::

    python -m verl_digen.sim.planner --model flux-12b --devices 32 --device-type H800
    python -m verl_digen.sim.planner --model wan2.1-14b --mix H800:16,A100:16 --json plan.json
    python -m verl_digen.sim.planner --model flux-12b --devices 16 --system verl-omni   # veRL-Omni's colocated run
    python -m verl_digen.sim.planner --model qwen-image-20b --devices 32 --reward qwen3-vl-8b-ocr  # a VLM judge
    python -m verl_digen.sim.planner --list            # the model, device, system and reward profiles it knows

``--system`` predicts another system (a profile in ``profiles/systems.yaml``) on the same
workload and cluster: ``verl-omni`` is veRL-Omni's colocated FlowGRPO as calibrated on its
published runs (``python -m verl_digen.sim.calibrate``). Each JSON row has ``step_s`` (seconds per
training step) and ``usd_per_1000_images`` (the devices' ``usd_per_hour``). What fits is the memory
planner's (``memory/plan.py``, the run's own check before any worker starts): each configuration's
per-GPU peak of every pool, for the model's real configs, against its device's memory
(``CostModel.memory_problems``); a dropped configuration's JSON row names the pool, its peak phase,
the GiB and the device.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from verl_digen.schedule.strategies import StrategySpec, call_rows, fsdp_rows_split, strategy_violations, tag_split
from verl_digen.sim.cost_model import Catalog, Cluster, CostModel, PoolPlacement, ProfileError, load_catalog
from verl_digen.sim.simulator import SimResult, simulate

# Mechanism sets the planner searches by default, in the order of the paper's ladder.
MECHANISMS: dict[str, dict[str, Any]] = {
    "colocated": {"placement": "colocated"},
    # every fused worker shards the model (digen.fsdp.enable): generation and micro-batches in lockstep
    "colocated+fsdp": {"placement": "colocated", "fsdp": True},
    "disaggregated": {"placement": "disaggregated"},
    "disaggregated+gap": {"placement": "disaggregated", "gap": True},
    "disaggregated+tcss": {"placement": "disaggregated", "max_staleness": 1},
    "disaggregated+gap+tcss": {"placement": "disaggregated", "gap": True, "max_staleness": 1},
    "disaggregated+gap+tsp": {"placement": "disaggregated", "gap": True, "tsp_stages": (2, 4)},
    "disaggregated+gap+tag": {"placement": "disaggregated", "gap": True, "tag": True},
    "disaggregated+gap+tsp+tag+tcss": {
        "placement": "disaggregated", "gap": True, "tsp_stages": (2, 4), "tag": True, "max_staleness": 1,
    },
    # FSDP in lockstep (digen.fsdp.enable): every micro-batch runs on all trainer ranks at once
    "disaggregated+gap+fsdp": {"placement": "disaggregated", "gap": True, "fsdp": True},
    "disaggregated+gap+fsdp+tcss": {"placement": "disaggregated", "gap": True, "fsdp": True, "max_staleness": 1},
    # TAG on FSDP trainers: every rank generates as many sample slices, its forwards in lockstep;
    # the rollout workers generate in slices of the same size, so that the groups the trainers
    # take shorten every rollout worker's queue (``"sample_slices": "tag"``)
    "disaggregated+gap+tag+fsdp": {
        "placement": "disaggregated", "gap": True, "tag": True, "fsdp": True, "sample_slices": "tag",
    },
    "disaggregated+gap+tag+fsdp+tcss": {
        "placement": "disaggregated", "gap": True, "tag": True, "fsdp": True, "max_staleness": 1,
        "sample_slices": "tag",
    },
    "disaggregated+gap+gat+fsdp+tcss": {
        "placement": "disaggregated", "gap": True, "gat": True, "fsdp": True, "max_staleness": 1,
    },
    # GAT (digen.gat.enable, LoRA only): rollout workers train part of the first mini-batch
    "disaggregated+gap+gat": {"placement": "disaggregated", "gap": True, "gat": True},
    "disaggregated+gap+gat+tcss": {"placement": "disaggregated", "gap": True, "gat": True, "max_staleness": 1},
}


def gat_not_applicable(costs: CostModel) -> str | None:
    """Why GAT's mechanism sets do not apply to ``costs`` (None: they do): GAT sends LoRA
    gradients, and it is this runtime's (an engine that always shards is not)."""
    if not costs.workload.lora:
        return "GAT needs LoRA (it sends the LoRA gradients to the trainers)"
    if costs.system.always_sharded:
        return f"GAT is this runtime's; system {costs.system.name!r} shards every run in its own engine"
    return None


@dataclass(frozen=True)
class PoolShape:
    """A pool as the runtime places it: ``on_nodes[i]`` devices of ``device`` on node ``i`` of
    the inventory (0 where it has none)."""

    on_nodes: tuple[int, ...]
    device: str

    @property
    def size(self) -> int:
        return sum(self.on_nodes)

    @property
    def nodes(self) -> int:
        return sum(1 for n in self.on_nodes if n)

    @property
    def placement(self) -> PoolPlacement:
        return PoolPlacement.spread(self.on_nodes, self.device)


@dataclass(frozen=True)
class Inventory:
    """The cluster: how many devices of each type, and devices per node."""

    devices: dict[str, int]
    per_node: int = 8

    @property
    def total(self) -> int:
        return sum(self.devices.values())

    def nodes_of(self, device: str) -> int:
        return math.ceil(self.devices[device] / self.per_node)


@dataclass(frozen=True)
class Candidate:
    spec: StrategySpec
    pools: dict[str, PoolShape]

    @property
    def cluster(self) -> Cluster:
        return Cluster({name: p.placement for name, p in self.pools.items()})

    @property
    def label(self) -> str:
        return self.spec.name


@dataclass
class Evaluation:
    candidate: Candidate
    result: SimResult | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return self.result is not None

    @property
    def images_per_s(self) -> float:
        return self.result.images_per_s if self.result else 0.0

    def row(self, colocated_images_per_s: float | None, costs: CostModel | None = None) -> dict[str, Any]:
        spec = self.candidate.spec
        pools = self.candidate.pools
        disagg = spec.placement == "disaggregated"
        r = self.result
        usd_per_hour = costs.usd_per_hour(self.candidate.cluster) if costs is not None else None
        row: dict[str, Any] = {
            "strategy": spec.name,
            "system": costs.system.name if costs is not None else None,
            "rollout_devices": spec.rollout_workers,  # colocated: the fused workers
            "trainer_devices": spec.trainer_workers if disagg else spec.rollout_workers,
            "rollout_device_type": pools["rollout" if disagg else "fused"].device,
            "trainer_device_type": pools["trainer" if disagg else "fused"].device,
            "reward_devices": spec.reward_workers,
            "reward": costs.reward.name if costs is not None and costs.reward is not None else None,
            "groups_per_task": spec.groups_per_task,
            "train_micro_batch_groups": spec.train_micro_batch_groups,
            "images_per_s": r.images_per_s if r else None,
            "step_time_s": r.step_time_s if r else None,
            "step_s": r.step_time_s if r else None,
            "bubble_fraction": r.bubble_fraction if r else None,
            "bound_images_per_s": r.bound_images_per_s if r else None,
            "fraction_of_bound": r.fraction_of_bound if r else None,
            "speedup_vs_colocated": (r.images_per_s / colocated_images_per_s) if (r and colocated_images_per_s) else None,
            "usd_per_hour": usd_per_hour,
            "usd_per_1000_images": (usd_per_hour / 3.6 / r.images_per_s) if (r and usd_per_hour) else None,
            "feasible": r is not None,
        }
        if self.problems:
            row["problems"] = self.problems
        return row


@dataclass
class Search:
    evaluations: list[Evaluation]
    costs: CostModel
    inventory: Inventory

    @property
    def evaluated(self) -> list[Evaluation]:
        return [e for e in self.evaluations if e.feasible]

    @property
    def best(self) -> Evaluation:
        if not self.evaluated:
            problems = sorted({p for e in self.evaluations for p in e.problems})
            raise ProfileError("no configuration fits: " + "; ".join(problems[:5]))
        return max(self.evaluated, key=lambda e: (e.images_per_s, -e.candidate.spec.devices))

    def best_of(self, label: str) -> Evaluation | None:
        evs = [e for e in self.evaluated if e.candidate.label == label]
        return max(evs, key=lambda e: e.images_per_s) if evs else None

    @property
    def best_colocated(self) -> Evaluation | None:
        """The best colocated configuration, with or without FSDP (the baseline of every speedup)."""
        evs = [e for e in self.evaluated if e.candidate.spec.placement == "colocated"]
        return max(evs, key=lambda e: e.images_per_s) if evs else None

    @property
    def colocated_images_per_s(self) -> float | None:
        best = self.best_colocated
        return best.images_per_s if best else None

    def ranked(self) -> list[Evaluation]:
        return sorted(self.evaluated, key=lambda e: -e.images_per_s)

    def rows(self) -> list[dict[str, Any]]:
        base = self.colocated_images_per_s
        return [e.row(base, self.costs) for e in self.ranked()]


# ---------------------------------------------------------------------------- enumeration


def placed(sizes: dict[str, int], per_node: int, nnodes: int, device: str) -> dict[str, PoolShape]:
    """Pools of ``sizes`` devices on ``nnodes`` nodes of ``per_node``, placed as the runtime
    places them (:func:`verl_digen.placement.pools.node_counts`)."""
    from verl_digen.platform.nodes import node_counts

    return {pool: PoolShape(counts, device) for pool, counts in node_counts(sizes, per_node, nnodes).items()}


def shard_groups_stay_in_nodes(pool: PoolShape, shard: int) -> bool:
    """HSDP (``shard`` = k > 0, fewer than the pool): the pool is whole shard groups of k ranks,
    each inside one node (the cost model charges NVLink for them and the gradient all-reduce
    between them). Flat FSDP (0, or k >= the pool) spans whatever nodes the pool spans."""
    if not 0 < shard < pool.size:
        return True
    return pool.size % shard == 0 and pool.placement.group_nodes(shard) == 1


def _divisors(n: int, options: Iterable[int]) -> list[int]:
    return [k for k in options if k <= n and n % k == 0]


def fsdp_micro_batches(micro: list[int], groups_per_step: int, group_size: int, ranks: int,
                       mini_batch_groups: int | None = None) -> list[int]:
    """Micro-batch sizes (groups) for FSDP over ``ranks``: those of ``micro`` whose rows deal
    evenly over the ranks (the runtime refuses the others), plus, for every transformer-call size
    (:func:`call_rows`) some micro-batch of the step reaches, the smallest micro-batch that reaches
    it (e.g. 12-sample groups over 32 ranks: 8 groups give 3 rows a call, 16 give 6, 32 give 12).

    Why the larger ones: under FSDP a micro-batch's rows are dealt over the ranks, so the micro-batch
    sets the rows of every rollout and training call (one number for both, for exact log-probs), and
    fuller calls run nearer the device's peak; the smallest micro-batch of each call size keeps
    GAP's pipeline as fine as that size allows. ``mini_batch_groups``: a micro-batch must divide a
    PPO mini-batch (default: the step)."""
    limit = mini_batch_groups or groups_per_step
    ok = [m for m in micro if fsdp_rows_split(m, group_size, ranks)]
    by_rows: dict[int, int] = {}
    for m in range(1, limit + 1):
        if limit % m == 0 and fsdp_rows_split(m, group_size, ranks):
            by_rows.setdefault(call_rows(group_size, m, ranks), m)
    return sorted(set(ok) | set(by_rows.values()))


def candidates(
    inventory: Inventory,
    *,
    groups_per_step: int,
    group_size: int,
    mechanisms: Iterable[str] = tuple(MECHANISMS),
    micro_batches: Iterable[int] = (1, 2),
    splits: Iterable[int] | None = None,
    num_steps: int = 8,
    whole_step: bool = False,
    hsdp_shard: int = 0,
    reward_devices: Iterable[int] = (0,),
    reward_placements: Iterable[str] = ("disaggregated",),
    ppo_mini_batches: int = 1,
) -> list[Candidate]:
    """Every configuration the planner evaluates. ``whole_step``: a system whose engine takes a
    worker's whole share of the step at once (one generate and one train task per worker).
    One device type: every rollout/trainer split ``r + (n - r)``, placed as the runtime places
    it (pools may fill part of a node and share it); ``hsdp_shard`` (the system's): splits whose
    training pool breaks an HSDP shard group across nodes are not offered.

    ``reward_devices``: reward pool sizes to try (0: the reward runs where the samples were
    generated); a pool of ``k`` devices is taken out of the cluster before the split, in the
    placements of ``reward_placements`` only (the system's). A cluster of two device types gets
    no reward pool (not modelled).

    ``ppo_mini_batches``: optimizer steps per training step in every plan (this runtime plans one
    per PPO mini-batch, and GAT may take micro-batches of the first only); micro-batch sizes that
    do not divide a mini-batch are not offered (the runtime refuses them)."""
    out: list[Candidate] = []
    placements = set(reward_placements)
    for k in dict.fromkeys(reward_devices):
        if k < 0 or k >= inventory.total - 1:
            raise ProfileError(f"a reward pool of {k} devices leaves too few of {inventory.total} to generate and train")
        if k and len(inventory.devices) > 1:
            continue
        labels = [m for m in mechanisms if not k or MECHANISMS.get(m, {}).get("placement") in placements]
        out.extend(_candidates_without_reward(
            inventory, groups_per_step=groups_per_step, group_size=group_size, mechanisms=labels,
            micro_batches=micro_batches, splits=splits, num_steps=num_steps, whole_step=whole_step,
            hsdp_shard=hsdp_shard, reward=k, ppo_mini_batches=ppo_mini_batches,
        ))
    return out


def _candidates_without_reward(
    inventory: Inventory,
    *,
    groups_per_step: int,
    group_size: int,
    mechanisms: Iterable[str],
    micro_batches: Iterable[int],
    splits: Iterable[int] | None,
    num_steps: int,
    whole_step: bool,
    hsdp_shard: int,
    reward: int,
    ppo_mini_batches: int = 1,
) -> list[Candidate]:
    """:func:`candidates` for one reward pool size ``reward`` (devices taken out of the
    inventory's one device type; 0: none)."""
    if ppo_mini_batches < 1 or groups_per_step % ppo_mini_batches:
        raise ProfileError(f"{ppo_mini_batches} PPO mini-batches do not divide {groups_per_step} groups per step")
    micro = [m for m in _divisors(groups_per_step, micro_batches) if (groups_per_step // ppo_mini_batches) % m == 0]
    types = sorted(inventory.devices, key=lambda t: -inventory.devices[t])
    if len(types) > 2:
        raise ProfileError(f"--mix supports at most two device types, got {', '.join(types)}")
    extra_pool = {"reward": reward} if reward else {}
    out: list[Candidate] = []
    for label in mechanisms:
        switches = MECHANISMS.get(label)
        if switches is None:
            raise ProfileError(f"unknown mechanism set {label!r}; valid: {', '.join(MECHANISMS)}")
        layouts: list[dict[str, PoolShape]] = []
        if switches["placement"] == "colocated":
            # a mixed colocated pool is not modelled: FSDP across device types runs at the slowest
            t, n = (types[0], inventory.devices[types[0]]) if len(types) == 1 else (types[-1], inventory.total)
            layouts.append(placed({"fused": n - reward, **extra_pool}, min(n, inventory.per_node),
                                  math.ceil(n / inventory.per_node), t))
        elif len(types) == 1:
            t = types[0]
            n = inventory.devices[t]
            for r in splits if splits is not None else range(1, n - reward):
                if not 0 < r < n - reward:
                    if splits is not None and reward and 0 < r < n:
                        continue  # an explicit split that the reward pool leaves no room for
                    raise ProfileError(f"a split of {n} devices needs 1..{n - 1} rollout devices, got {r}")
                layouts.append(placed({"rollout": r, "trainer": n - reward - r, **extra_pool}, min(n, inventory.per_node),
                                      inventory.nodes_of(t), t))
        else:
            # each pool on the nodes of its own device type: the first type's nodes, then the second's
            before = {types[0]: 0, types[1]: inventory.nodes_of(types[0])}
            after = {types[0]: inventory.nodes_of(types[1]), types[1]: 0}
            for r_type, t_type in ((types[0], types[1]), (types[1], types[0])):
                pools = {}
                for pool, dtype in (("rollout", r_type), ("trainer", t_type)):
                    own = placed({pool: inventory.devices[dtype]}, min(inventory.devices[dtype], inventory.per_node),
                                 inventory.nodes_of(dtype), dtype)[pool].on_nodes
                    pools[pool] = PoolShape((0,) * before[dtype] + own + (0,) * after[dtype], dtype)
                layouts.append(pools)
        layouts = [p for p in layouts if shard_groups_stay_in_nodes(p["fused" if "fused" in p else "trainer"], hsdp_shard)]
        for pools in layouts:
            sizes = micro
            if whole_step and reward:
                # a reward pool streams finished samples to the reward: unit generate tasks
                # (veRL-Omni's async-reward mode; sim/calibrate.py run_plan)
                sizes = [1]
            elif whole_step:
                n = pools["fused" if "fused" in pools else "rollout"].size
                if groups_per_step % n:
                    raise ProfileError(f"{groups_per_step} groups per step do not divide over {n} workers, which a "
                                       f"whole-step system needs (change --groups-per-step)")
                sizes = [groups_per_step // n]
            for gpt in sizes:
                fused = "fused" in pools
                mbs = sizes
                if "fsdp" in switches:
                    mbs = fsdp_micro_batches(sizes, groups_per_step, group_size, pools["fused" if fused else "trainer"].size,
                                             groups_per_step // ppo_mini_batches)
                for mb in mbs:
                    if fused:
                        fsdp = bool(switches.get("fsdp"))
                        if fsdp and strategy_violations(placement="colocated", rollout_workers=pools["fused"].size,
                                                         groups_per_step=groups_per_step, groups_per_task=gpt,
                                                         train_micro_batch_groups=mb, fsdp=True):
                            continue  # the runtime refuses it: every fused worker must generate alike
                        spec = StrategySpec(
                            "colocated", pools["fused"].size, pools["fused"].size, groups_per_step, group_size,
                            groups_per_task=gpt, train_micro_batch_groups=mb, fsdp=fsdp, reward_workers=reward,
                            mini_batches=ppo_mini_batches,
                        )
                        out.append(Candidate(spec, pools))
                        continue
                    common = dict(
                        groups_per_task=gpt, train_micro_batch_groups=mb, gap=switches.get("gap", False),
                        max_staleness=switches.get("max_staleness", 0), reward_workers=reward,
                        mini_batches=ppo_mini_batches,
                    )
                    if "tag" in switches:
                        common["tag"] = True
                    if "gat" in switches:
                        common["gat"] = True
                    if "fsdp" in switches:
                        if not fsdp_rows_split(mb, group_size, pools["trainer"].size):
                            continue  # the runtime refuses it (DigenConfig.validate): ranks would take unequal shares
                        common["fsdp"] = True
                    if switches.get("sample_slices") == "tag" and common.get("fsdp"):
                        ranks = pools["trainer"].size  # TAG's slices, of the calls a whole group's task makes
                        common["sample_slices"] = tag_split(group_size, ranks, call_rows(group_size, mb, ranks, 1))
                    stages = [1]
                    if "tsp_stages" in switches:
                        common["num_steps"] = num_steps
                        stages = [k for k in switches["tsp_stages"] if pools["rollout"].size % k == 0 and k <= num_steps]
                    for k in stages:
                        extra = {"tsp_stages": k} if "tsp_stages" in switches else {}
                        spec = StrategySpec(
                            "disaggregated", pools["rollout"].size, pools["trainer"].size, groups_per_step, group_size,
                            **common, **extra,
                        )
                        out.append(Candidate(spec, pools))
    return out


def reward_pool_sizes(costs: CostModel, inventory: Inventory) -> list[int]:
    """The reward pool sizes the planner tries by default: none, and for a reward model with
    weights 1, 2, 4, ... devices up to a quarter of the cluster. A reward without a model (a
    rule, e.g. JPEG size) gets no pool. A cluster of two device types gets none (not modelled)."""
    r = costs.reward
    if r is None or not r.params or len(inventory.devices) > 1:
        return [0]
    sizes, k = [0], 1
    while k <= inventory.total // 4:
        sizes.append(k)
        k *= 2
    return sizes


def evaluate(candidate: Candidate, costs: CostModel, *, steps: int = 5, warmup: int = 2) -> Evaluation:
    cluster = candidate.cluster
    costs = costs.for_spec(candidate.spec)  # the strategy's transformer calls and sharding
    problems = costs.memory_problems(cluster)  # the memory planner's peaks (for_spec carries TAG)
    if problems:
        return Evaluation(candidate, None, problems)
    return Evaluation(candidate, simulate(candidate.spec, costs, cluster, steps=steps, warmup=warmup))


def search(
    costs: CostModel,
    inventory: Inventory,
    *,
    mechanisms: Iterable[str] = tuple(MECHANISMS),
    micro_batches: Iterable[int] = (1, 2),
    steps: int = 5,
    warmup: int = 2,
    reward_devices: Iterable[int] | None = None,
) -> Search:
    """Evaluate every candidate; ``reward_devices``: the reward pool sizes to try (None:
    :func:`reward_pool_sizes`), in the placements where the system places a reward pool."""
    w = costs.workload
    sizes = list(reward_devices) if reward_devices is not None else reward_pool_sizes(costs, inventory)
    if any(sizes) and (costs.reward is None or not costs.reward.params):
        raise ProfileError(f"a reward pool needs a reward model with weights; the workload's reward is "
                           f"{costs.reward.name if costs.reward else 'none'} (pick one with --reward)")
    runnable = [m for m in mechanisms if m not in MECHANISMS or costs.system.runs(MECHANISMS[m]["placement"])]
    if costs.system.always_sharded:  # its engine shards every run; our lockstep-FSDP plans are not its
        runnable = [m for m in runnable if not MECHANISMS.get(m, {}).get("fsdp")]
    no_gat = gat_not_applicable(costs)
    if no_gat:  # not offered (a full fine-tune, or a system that shards)
        runnable = [m for m in runnable if not MECHANISMS.get(m, {}).get("gat")]
    if not runnable:
        if no_gat and any(MECHANISMS.get(m, {}).get("gat") for m in mechanisms):
            raise ProfileError(f"none of {', '.join(mechanisms)} applies: {no_gat}")
        raise ProfileError(f"system {costs.system.name!r} runs only {costs.system.placements}; none of "
                           f"{', '.join(mechanisms)} applies")
    cands = candidates(
        inventory, groups_per_step=w.groups_per_step, group_size=w.group_size, mechanisms=runnable,
        micro_batches=micro_batches, num_steps=w.num_steps, whole_step=costs.system.whole_step_tasks,
        # this runtime plans an optimizer step per PPO mini-batch; a whole-step engine steps
        # its mini-batches inside one task (CostModel.for_spec keeps the workload's count then)
        ppo_mini_batches=1 if costs.system.whole_step_tasks else w.mini_batches,
        hsdp_shard=costs.system.hsdp_shard, reward_devices=sizes,
        reward_placements=[p for p in ("colocated", "disaggregated") if costs.system.reward_pool_in(p)],
    )
    return Search([evaluate(c, costs, steps=steps, warmup=warmup) for c in cands], costs, inventory)


# ---------------------------------------------------------------------------- output


def hydra_overrides(candidate: Candidate, costs: CostModel, inventory: Inventory) -> list[str]:
    """The ``python -m verl_digen.main`` overrides that run ``candidate``."""
    spec, w = candidate.spec, costs.workload
    # a served reward (a judge behind its own inference server) keeps its devices outside the job
    served = spec.reward_workers if costs.reward is not None and costs.reward.served else 0
    total = inventory.total - served
    nnodes = math.ceil(total / inventory.per_node)
    out = [
        f"trainer.n_gpus_per_node={min(inventory.per_node, total)}",
        f"trainer.nnodes={nnodes}",
        f"digen.placement={spec.placement}",
    ]
    if spec.placement == "disaggregated":
        mixed = len(inventory.devices) > 1
        for pool in ("rollout", "trainer"):
            p = candidate.pools[pool]
            # the pool's total; the runtime places it on the nodes as the planner did (nodes unset)
            out += [f"digen.pools.{pool}.devices={p.size}", f"digen.pools.{pool}.nodes=null"]
            if mixed:
                out.append(f"digen.pools.{pool}.accelerator_type={p.device}")
        if spec.reward_workers and not served:
            out += [f"digen.pools.reward.devices={spec.reward_workers}", "digen.pools.reward.nodes=null"]
    out += [
        f"digen.batch.groups_per_step={spec.groups_per_step}",
        f"digen.batch.group_size={spec.group_size}",
        f"digen.batch.groups_per_task={spec.groups_per_task}",
        f"digen.batch.train_micro_batch_groups={spec.train_micro_batch_groups}",
        f"digen.batch.mini_batches_per_step={getattr(spec, 'mini_batches', 1)}",
        f"digen.gap.enable={'true' if spec.gap else 'false'}",
        f"digen.async.max_staleness={spec.max_staleness}",
        f"digen.tsp.stages={getattr(spec, 'tsp_stages', 1)}",
        f"digen.tsp.train_split={getattr(spec, 'train_split', 'sample')}",
        f"digen.tag.enable={'true' if getattr(spec, 'tag', False) else 'false'}",
        f"digen.gat.enable={'true' if getattr(spec, 'gat', False) else 'false'}",
        f"digen.fsdp.enable={'true' if getattr(spec, 'fsdp', False) else 'false'}",
        f"digen.sampling.height={w.height}",
        f"digen.sampling.width={w.width}",
        f"digen.sampling.num_frames={w.frames}",
        f"digen.sampling.num_steps={w.num_steps}",
    ]
    # work units (the planner does not search them; a spec built with them prints them)
    if getattr(spec, "pull", False):
        out.append("digen.units.pull=true")
    if getattr(spec, "sample_slices", None) is not None:
        out.append(f"digen.units.sample_slices={spec.sample_slices}")
    if getattr(spec, "train_slices", 1) != 1:
        out.append(f"digen.units.train_slices={spec.train_slices}")
    if getattr(spec, "train_micro_batch_rows", None) is not None:  # passes below the largest call (not searched)
        out.append(f"digen.batch.train_micro_batch_rows={spec.train_micro_batch_rows}")
    if w.vae_decode_chunk:
        out.append(f"digen.model.vae_decode_chunk={w.vae_decode_chunk}")
    if w.sde_window and w.sde_window < w.num_steps:
        out += ["digen.sampling.sde_window.mode=random", f"digen.sampling.sde_window.size={w.sde_window}"]
    out.append(f"digen.sampling.timestep_fraction={w.timestep_fraction}")
    out.append(f"digen.model.lora.enable={'true' if w.lora else 'false'}")
    if w.lora:
        out.append(f"digen.model.lora.rank={w.lora_rank}")
    if spec.placement == "disaggregated":  # what the simulation assumed, not left to the run's own auto
        spec_costs = costs.for_spec(spec)
        trainers = candidate.pools["trainer"]
        parked = spec_costs.optimizer_parked(spec_costs.device(trainers.device), spec_costs.train_group(candidate.cluster))
        out.append(f"digen.model.optimizer_offload={'true' if parked else 'false'}")
    return out


def reward_note(candidate: Candidate, costs: CostModel) -> str | None:
    """What the hydra overrides cannot say: a served reward's pool is its server's devices."""
    r, k = costs.reward, candidate.spec.reward_workers
    if not k or r is None or not r.served:
        return None
    return (f"serve {r.name} on {k} devices of its own ({k} replica(s) of one device each) and point the job's "
            f"reward at that server (digen.reward.kwargs.base_url); the overrides count only the job's "
            f"{candidate.spec.devices - k} devices")


def format_table(rows: list[dict[str, Any]], top: int | None = None) -> str:
    head = (f"{'#':>3} {'strategy':<28} {'rollout':>8} {'trainer':>8} {'reward':>6} {'g/task':>6} {'g/mb':>5} {'img/s':>9} {'step s':>8} "
            f"{'bubble':>7} {'bound':>9} {'%bound':>7} {'vs coloc':>8} {'$/1k img':>9}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows[:top] if top else rows, 1):
        ro = f"{r['rollout_devices']}"
        tr = f"{r['trainer_devices']}"
        if r["rollout_device_type"] != r["trainer_device_type"]:
            ro += f"x{r['rollout_device_type']}"
            tr += f"x{r['trainer_device_type']}"
        speed = f"{r['speedup_vs_colocated']:.2f}x" if r["speedup_vs_colocated"] else "-"
        usd = f"{r['usd_per_1000_images']:.2f}" if r.get("usd_per_1000_images") else "-"
        lines.append(
            f"{i:>3} {r['strategy']:<28} {ro:>8} {tr:>8} {r.get('reward_devices') or '-':>6} {r['groups_per_task']:>6} {r['train_micro_batch_groups']:>5} "
            f"{r['images_per_s']:>9.3f} {r['step_s']:>8.1f} {r['bubble_fraction']:>7.3f} {r['bound_images_per_s']:>9.3f} "
            f"{100 * r['fraction_of_bound']:>6.1f}% {speed:>8} {usd:>9}"
        )
    return "\n".join(lines)


def parse_mix(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, count = part.partition(":")
        if not name or not count.isdigit() or int(count) < 1:
            raise ProfileError(f"--mix {text!r}: expected TYPE:COUNT[,TYPE:COUNT], e.g. H800:16,A100:16")
        out[name.strip()] = out.get(name.strip(), 0) + int(count)
    return out


def parse_sizes(text: str, flag: str) -> list[int]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isdigit() for x in parts):
        raise ProfileError(f"{flag} {text!r}: expected a comma list of device counts, e.g. 0,4,8")
    return [int(x) for x in parts]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_digen.sim.planner", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="flux-12b", help="model profile name")
    p.add_argument("--devices", type=int, default=None, help="number of devices (all of --device-type)")
    p.add_argument("--device-type", default="H800", help="device profile name (H100, H800, A100, ...)")
    p.add_argument("--mix", default=None, help="heterogeneous cluster, e.g. H800:16,A100:16 (replaces --devices)")
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--profile", action="append", default=[], help="extra profile YAML file (repeatable)")
    p.add_argument("--system", default=None,
                   help="system profile to predict (default: the devices' own, verl-digen); verl-omni = veRL-Omni's colocated run")
    p.add_argument("--groups-per-step", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="denoising steps per sample")
    p.add_argument("--sde-window", type=int, default=None, help="trained (SDE) steps per trajectory; 0 = all")
    p.add_argument("--vae-decode-chunk", type=int, default=None,
                   help="samples per VAE decode call (digen.model.vae_decode_chunk; default 0: a generate call's all)")
    p.add_argument("--lora", action=argparse.BooleanOptionalAction, default=None, help="LoRA instead of full fine-tuning")
    p.add_argument("--reward", default=None, help="reward profile (see --list; default: the model profile's)")
    p.add_argument("--reward-devices", default=None,
                   help="comma list of reward pool sizes to try, 0 = no pool (default: 0 and 1, 2, 4, ... "
                        "devices up to a quarter of the cluster, for a reward model with weights)")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS),
                   help=f"comma list of: {', '.join(MECHANISMS)}")
    p.add_argument("--micro-batches", default="1,2",
                   help="groups per generate call / per train micro-batch to try (under FSDP also the smallest "
                        "micro-batch of each transformer-call size the ranks allow)")
    p.add_argument("--sim-steps", type=int, default=5, help="simulated training steps per configuration")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default=None, help="write every evaluated row as JSON to this file")
    p.add_argument("--list", action="store_true", help="list the known model and device profiles")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        catalog: Catalog = load_catalog(args.profile)
        if args.list:
            print("models: " + ", ".join(sorted(catalog.models)))
            print("devices: " + ", ".join(sorted(catalog.devices)))
            print("systems: " + ", ".join(sorted(catalog.systems)))
            print("rewards: " + ", ".join(sorted(catalog.rewards)))
            return 0
        if args.mix:
            inventory = Inventory(parse_mix(args.mix), args.devices_per_node)
        else:
            if not args.devices or args.devices < 2:
                raise ProfileError("--devices must be at least 2 (or use --mix)")
            inventory = Inventory({args.device_type: args.devices}, args.devices_per_node)
        for t, n in inventory.devices.items():
            if n > inventory.per_node and n % inventory.per_node:
                raise ProfileError(f"{n} {t} devices do not fill whole nodes of --devices-per-node={inventory.per_node}")
        costs = CostModel.from_catalog(
            catalog, args.model, devices=list(inventory.devices), system=args.system, groups_per_step=args.groups_per_step,
            group_size=args.group_size, height=args.height, width=args.width, frames=args.frames,
            num_steps=args.steps, sde_window=args.sde_window, lora=args.lora, reward=args.reward,
            vae_decode_chunk=args.vae_decode_chunk,
        )
        result = search(
            costs, inventory, mechanisms=[m.strip() for m in args.mechanisms.split(",") if m.strip()],
            micro_batches=[int(x) for x in args.micro_batches.split(",")], steps=args.sim_steps,
            reward_devices=parse_sizes(args.reward_devices, "--reward-devices") if args.reward_devices else None,
        )
        best = result.best
    except ProfileError as e:
        print(f"[verl-digen plan] error: {e}", file=sys.stderr)
        return 2
    rows = result.rows()
    d = costs.describe(best.candidate.cluster)
    print(
        f"{args.model} on {' + '.join(f'{n} x {t}' for t, n in inventory.devices.items())}, system {costs.system.name}: "
        f"{d['sequence_tokens']} tokens/sample, {d['forward_tflops_per_sample']:.1f} TFLOP/forward, "
        f"{costs.workload.images_per_step} images/step ({costs.workload.groups_per_step} groups of {costs.workload.group_size}), "
        f"{'LoRA' if costs.workload.lora else 'full fine-tuning'}, reward {costs.reward.name if costs.reward else 'without a model'}"
    )
    print(f"evaluated {len(result.evaluated)} configurations ({len(result.evaluations) - len(result.evaluated)} do not fit in memory)")
    print(format_table(rows, args.top))
    print(f"\nbest: {best.candidate.label}, {best.images_per_s:.3f} images/s "
          f"({100 * best.result.fraction_of_bound:.1f}% of the zero-bubble bound)")
    print("hydra overrides:\n  " + " \\\n  ".join(hydra_overrides(best.candidate, costs, inventory)))
    note = reward_note(best.candidate, costs)
    if note:
        print(f"reward: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "inventory": inventory.devices, "rows": rows,
                       "system": costs.system.name,
                       "skipped": [{**e.row(None, costs), "problems": e.problems} for e in result.evaluations if not e.feasible],
                       "best_overrides": hydra_overrides(best.candidate, costs, inventory)}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
