"""Per-step decisions from measured rates: TAG's share, GAT's share and TSP's stage boundaries.

Both are pure functions of a :class:`~verl_digen.schedule.timeline.Timeline`, so the Ray loop
and the simulator decide the same way (:class:`~verl_digen.schedule.driver.StepDriver` calls
them for both).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TagInputs:
    """Measured seconds per group (per worker) and pool sizes for one step."""

    groups_per_step: int
    groups_per_task: int
    rollout_workers: int
    trainer_workers: int
    rollout_generate_per_group: float  # one rollout worker
    trainer_generate_per_group: float  # one trainer worker
    train_per_group: float  # one trainer rank (FSDP: the gang's seconds per group)
    switch_s: float  # a trainer switching from generating to training (once per step)
    # FSDP trainers: every micro-batch trains on all of them at once, and every rank generates
    # as many TAG tasks as the others (their forwards are collectives, in lockstep)
    gang: bool = False
    # the share comes in multiples of this many groups (StrategySpec.tag_unit; 0: groups_per_task)
    share_unit: int = 0
    # How the work is cut: generate tasks per chunk of groups_per_task groups on the rollout
    # workers (StrategySpec.sample_split) and on the trainers (tag_split); the rollout lanes the
    # tasks are dealt over (TSP: its pipelines; 0: every rollout worker). A worker's share is
    # whole tasks, so the busiest one sets the pool's time.
    rollout_split: int = 1
    tag_split: int = 1
    rollout_lanes: int = 0

    @property
    def unit(self) -> int:
        return self.share_unit or self.groups_per_task


@dataclass(frozen=True)
class TagDecision:
    groups: int
    predicted_step_s: float
    predicted_step_s_without: float
    reason: str

    def as_metrics(self, inputs: TagInputs | None) -> dict[str, float]:
        return _decision_metrics("tag", "groups", self, inputs)


def _decision_metrics(prefix: str, share: str, decision: Any, inputs: Any) -> dict[str, float]:
    """An elastic decision as ``<prefix>/*`` metrics: its share, both predictions, its inputs."""
    m = {
        f"{prefix}/{share}": float(getattr(decision, share)),
        f"{prefix}/predicted_step_s": decision.predicted_step_s,
        f"{prefix}/predicted_step_s_without": decision.predicted_step_s_without,
    }
    if inputs is not None:
        m.update({f"{prefix}/{k}": float(v) for k, v in asdict(inputs).items()})
    return m


def seconds_per_group(timeline: Any, kind: str, step: int, pool: str | None = None) -> float | None:
    """Seconds per group of the ``kind`` tasks of ``step`` on workers of ``pool`` (None: any):
    their summed durations over the distinct groups they served (a group's TSP stages and
    sample slices count once). None when no such task ran."""
    rs = [r for r in timeline.of_step(step) if r.kind == kind and (pool is None or r.workers[0].startswith(pool))]
    groups = {g for r in rs for g in r.groups}
    return sum(r.end - r.start for r in rs) / len(groups) if groups else None


def latest_seconds_per_group(timeline: Any, kind: str, step: int, pool: str, *, default: float) -> float:
    """:func:`seconds_per_group` of the latest step up to ``step`` where ``pool`` ran ``kind``
    tasks (an elastic share's assisting pool may not have run any yet); ``default`` if none did."""
    for at in range(step, -1, -1):
        v = seconds_per_group(timeline, kind, at, pool)
        if v is not None:
            return v
    return default


def _step_rates(timeline: Any, step: int, *, train_pool: str | None) -> tuple[float, float] | None:
    """Step ``step``'s rollout generation and training (on ``train_pool``; None: any worker)
    seconds per group, or None when it measured either not yet."""
    if step < 0:
        return None
    roll = seconds_per_group(timeline, "generate", step, "rollout")
    train = seconds_per_group(timeline, "train", step, train_pool)
    return None if roll is None or train is None else (roll, train)


def tag_inputs_from_timeline(spec, timeline, step: int, switch_s: float) -> TagInputs | None:
    """TAG's inputs for the step after ``step``, from a :class:`Timeline`'s records of ``step``.

    Per-group seconds on one worker: rollout generation, training (all parts summed), and
    trainer generation (the latest step where trainers generated; until then the rollout
    rate, i.e. the same device type). None when ``step`` measured nothing yet.
    """

    rates = _step_rates(timeline, step, train_pool=None)
    if rates is None:
        return None
    roll, train = rates
    trainer_gen = latest_seconds_per_group(timeline, "generate", step, "trainer", default=roll)
    return _tag_inputs(spec, roll, trainer_gen, train, switch_s)


def _tag_inputs(spec, roll: float, trainer_gen: float, train: float, switch_s: float) -> TagInputs:
    return TagInputs(
        groups_per_step=spec.groups_per_step,
        groups_per_task=spec.groups_per_task,
        rollout_workers=spec.rollout_workers,
        trainer_workers=spec.trainer_workers,
        rollout_generate_per_group=roll,
        trainer_generate_per_group=trainer_gen,
        train_per_group=train,
        switch_s=switch_s,
        gang=bool(getattr(spec, "fsdp", False)),
        share_unit=spec.tag_unit,
        rollout_split=spec.sample_split,
        tag_split=spec.tag_split,
        rollout_lanes=spec.pipelines,
    )


def tag_inputs_from_costs(spec, costs, switch_s: float) -> TagInputs:
    """TAG's inputs from per-unit costs (a :class:`~verl_digen.schedule.mechanisms.StepCosts`
    the cost model predicts) instead of a step's records: the steady-state simulator decides
    with them before anything is measured. A group's training seconds there are one worker's;
    a gang's records measure its wall time, which is that over its ranks."""
    ranks = spec.trainer_workers if getattr(spec, "fsdp", False) else 1
    return _tag_inputs(spec, costs.generate_per_group, costs.generate_per_group, costs.train_per_group / ranks,
                       switch_s)


def _phase_time(inp: TagInputs, n: int) -> float:
    """Time until both pools are done with the step's generation-and-training work.

    Rollout generates ``G - n`` groups; trainers generate ``n`` (plus one switch) and train
    all ``G``. The step cannot end before the slower of the two pools, nor a pool before its
    busiest worker (whole tasks each).
    """
    g, per_task = inp.groups_per_step, inp.groups_per_task
    lanes = inp.rollout_lanes or inp.rollout_workers
    # the busiest lane's tasks; a task of a TSP pipeline takes its lane 1 / stages of its work
    tasks = (g - n) // per_task * inp.rollout_split
    rollout = math.ceil(tasks / lanes) * per_task * inp.rollout_generate_per_group * lanes / (
        inp.rollout_split * inp.rollout_workers)
    tag_tasks = n // per_task * inp.tag_split
    trainer = math.ceil(tag_tasks / inp.trainer_workers) * per_task * inp.trainer_generate_per_group / inp.tag_split
    trainer += (inp.switch_s if n else 0.0) + g * inp.train_per_group / (1 if inp.gang else inp.trainer_workers)
    return max(rollout, trainer)


def decide_tag_share(inp: TagInputs) -> TagDecision:
    """How many of the step's groups the trainers should generate (whole tasks only; FSDP
    trainers: a whole number of tasks per rank, :attr:`TagInputs.unit`).

    Chooses the share that minimises the step's predicted time, i.e. that makes both pools
    finish together; assigns nothing unless that strictly beats not assisting (e.g. when the
    trainers are already the bottleneck, or switching costs more than it saves).
    """
    without = _phase_time(inp, 0)
    best_n, best_t = 0, without
    for n in range(inp.unit, inp.groups_per_step + 1, inp.unit):
        t = _phase_time(inp, n)
        if t < best_t - 1e-12:
            best_n, best_t = n, t
    if best_n == 0:
        reason = "assisting does not pay: trainers are the bottleneck or the switch costs more than it saves"
    else:
        reason = "trainers generate while they would otherwise wait for the first groups"
    return TagDecision(groups=best_n, predicted_step_s=best_t, predicted_step_s_without=without, reason=reason)


def tag_decision(spec: Any, timeline: Any, step: int, switch_s: float, fixed: int | None = None, *,
                 measured: int | None = None, prior: Any = None) -> tuple[dict[str, float], int]:
    """TAG's share of step ``step`` (groups the trainers generate) from the rates measured in
    step ``measured`` (default ``step - 1``; or ``fixed``, ``digen.tag.groups``), and the
    decision's metrics. ``prior``: predicted per-unit costs to decide with while nothing is
    measured (:func:`tag_inputs_from_costs`; None: assign nothing then). ``({}, 0)`` when TAG
    is off."""
    if not spec.tag:
        return {}, 0
    inputs = tag_inputs_from_timeline(spec, timeline, step - 1 if measured is None else measured, switch_s)
    if inputs is None and prior is not None:
        inputs = tag_inputs_from_costs(spec, prior, switch_s)
    if fixed is not None:
        t = _phase_time(inputs, fixed) if inputs else 0.0
        without = _phase_time(inputs, 0) if inputs else 0.0
        return TagDecision(fixed, t, without, "fixed by digen.tag.groups").as_metrics(inputs), fixed
    if inputs is None:
        return TagDecision(0, 0.0, 0.0, "no measurements yet").as_metrics(None), 0
    d = decide_tag_share(inputs)
    return d.as_metrics(inputs), d.groups


@dataclass(frozen=True)
class GatInputs:
    """GAT's inputs for one step: the step's shape and measured seconds per group (one worker)."""

    groups_per_step: int
    train_micro_batch_groups: int
    first_mini_batch: int  # micro-batches of the step's first PPO mini-batch (GAT's at most)
    rollout_workers: int
    trainer_workers: int
    rollout_generate_per_group: float  # the rollout pool's worker-seconds per group (stages, slices summed)
    train_per_group: float  # one trainer (FSDP: the gang's seconds per group)
    rollout_train_per_group: float  # one rollout worker training (its passes; the gradients travel later)
    gang: bool = False  # FSDP trainers: every micro-batch runs on all of them in lockstep
    lookahead: bool = False  # TCSS: rollout trains before it generates the next step, not after this one
    pulled_slices: int = 0  # pulled units (digen.units.pull): row slices per micro-batch; 0: round-robin


@dataclass(frozen=True)
class GatDecision:
    micro_batches: int
    predicted_step_s: float
    predicted_step_s_without: float
    reason: str

    def as_metrics(self, inputs: GatInputs | None) -> dict[str, float]:
        return _decision_metrics("gat", "micro_batches", self, inputs)


def gat_step_time(inp: GatInputs, n: int) -> float:
    """Predicted time until both pools are done with a step whose rollout workers train ``n``
    micro-batches (the last of the first PPO mini-batch, dealt one per rollout worker in turn).

    Rollout generates its groups and trains its micro-batches: before generating the next step
    under TCSS (``lookahead``), after this step's groups otherwise (its queue's order). The
    trainers train the rest of the first mini-batch: unsharded, micro-batch ``j`` on trainer
    ``j mod T`` (``schedule/mechanisms.py``), or pulled, its row slices spread evenly over them;
    FSDP (``gang``), every micro-batch on all of them.
    The first mini-batch's optimizer step waits for the rollout's micro-batches too, and the
    later mini-batches wait for that step."""
    mb = inp.train_micro_batch_groups
    total = inp.groups_per_step // mb
    first = inp.first_mini_batch
    assisted = set(range(first - n, first))

    def trainers(micro_batches: range) -> float:
        own = [j for j in micro_batches if j not in assisted]
        if inp.gang:
            return len(own) * mb * inp.train_per_group
        if inp.pulled_slices:  # the free trainer takes the next slice: the slices spread evenly
            k = inp.pulled_slices
            return math.ceil(len(own) * k / inp.trainer_workers) * mb * inp.train_per_group / k
        per_trainer = Counter(j % inp.trainer_workers for j in own)
        return max(per_trainer.values(), default=0) * mb * inp.train_per_group

    generate = inp.groups_per_step * inp.rollout_generate_per_group / inp.rollout_workers
    assist = math.ceil(n / inp.rollout_workers) * mb * inp.rollout_train_per_group
    assisted_done = 0.0 if not n else (assist if inp.lookahead else generate + assist)
    trained = max(trainers(range(first)), assisted_done) + trainers(range(first, total))
    return max(generate + assist, trained)


def decide_gat_share(inp: GatInputs) -> GatDecision:
    """How many micro-batches the rollout workers should train: the count that minimises the
    predicted step; none unless that strictly beats not assisting (rollout is the bottleneck,
    or its training is too slow to help)."""
    without = gat_step_time(inp, 0)
    best_n, best_t = 0, without
    for n in range(1, inp.first_mini_batch + 1):
        t = gat_step_time(inp, n)
        if t < best_t - 1e-12:
            best_n, best_t = n, t
    reason = ("rollout trains while it would otherwise wait for the trainers" if best_n else
              "assisting does not pay: rollout is the bottleneck or trains too slowly to help")
    return GatDecision(best_n, best_t, without, reason)


def gat_inputs_from_timeline(spec: Any, timeline: Any, step: int) -> GatInputs | None:
    """GAT's inputs for the step after ``step``, from a :class:`Timeline`'s records of ``step``:
    rollout generation and trainer training per group on one worker, and rollout training (the
    latest step where rollout trained; until then the trainers' rate, i.e. the same device
    type). None when ``step`` measured nothing yet."""

    rates = _step_rates(timeline, step, train_pool="trainer")
    if rates is None:
        return None
    roll, train = rates
    # until rollout has trained: a trainer's rate on the same device type (a gang's takes T ranks)
    unsharded = train * (spec.trainer_workers if spec.fsdp else 1)
    rollout_train = latest_seconds_per_group(timeline, "train", step, "rollout", default=unsharded)
    return GatInputs(
        groups_per_step=spec.groups_per_step,
        train_micro_batch_groups=spec.train_micro_batch_groups,
        first_mini_batch=spec.micro_batches_per_mini_batch,
        rollout_workers=spec.rollout_workers,
        trainer_workers=spec.trainer_workers,
        rollout_generate_per_group=roll,
        train_per_group=train,
        rollout_train_per_group=rollout_train,
        gang=bool(spec.fsdp),
        lookahead=spec.max_staleness >= 1,
        pulled_slices=spec.train_slices if spec.pull else 0,
    )


def gat_decision(spec: Any, timeline: Any, step: int, fixed: int | None = None) -> tuple[dict[str, float], int]:
    """GAT's micro-batches for step ``step`` from the rates measured in step ``step - 1`` (or
    ``fixed``, ``digen.gat.micro_batches``), and the decision's metrics. ``({}, 0)`` when GAT is off."""
    if not spec.gat:
        return {}, 0
    inputs = gat_inputs_from_timeline(spec, timeline, step - 1)
    if fixed is not None:
        t = gat_step_time(inputs, fixed) if inputs else 0.0
        without = gat_step_time(inputs, 0) if inputs else 0.0
        return GatDecision(fixed, t, without, "fixed by digen.gat.micro_batches").as_metrics(inputs), fixed
    if inputs is None:
        return GatDecision(0, 0.0, 0.0, "no measurements yet").as_metrics(None), 0
    d = decide_gat_share(inputs)
    return d.as_metrics(inputs), d.micro_batches


def balanced_spec(spec: Any, profile: dict[str, Any]) -> Any:
    """TSP: ``spec`` with stage ranges balanced by a per-step cost profile
    (``{"step_s": [...], "head_s": ..., "tail_s": ...}``, measured on a rollout worker or modelled)."""
    bounds = balance_stages(profile["step_s"], spec.tsp_stages, head_s=profile["head_s"], tail_s=profile["tail_s"])
    return dataclasses.replace(spec, stage_bounds=bounds)


def rebalanced_spec(spec: Any, timeline: Any, step: int) -> Any:
    """TSP: move stage boundaries using the stage durations measured in ``step``.

    Each stage's measured time (its steps plus what a profile cannot see: receiving the
    in-flight state, packing and shipping the record) is spread over its steps; the boundaries
    move only when that predicts a >10% shorter slowest stage. Returns ``spec`` unchanged
    otherwise (the same object).
    """
    bounds = spec.bounds
    k = spec.tsp_stages
    per_stage: list[list[float]] = [[] for _ in range(k)]
    for r in timeline.of_step(step):
        if r.kind == "generate" and r.stage is not None:
            per_stage[r.stage].append(r.end - r.start)
    if not all(per_stage):
        return spec
    means = [sum(v) / len(v) for v in per_stage]
    step_costs = [means[i] / (bounds[i + 1] - bounds[i]) for i in range(k) for _ in range(bounds[i], bounds[i + 1])]
    new = balance_stages(step_costs, k)

    def slowest(b: tuple[int, ...]) -> float:
        return max(sum(step_costs[b[i]:b[i + 1]]) for i in range(k))

    if new != tuple(bounds) and slowest(new) < 0.9 * slowest(bounds):
        return dataclasses.replace(spec, stage_bounds=new)
    return spec


def balance_stages(step_costs: list[float], stages: int, *, head_s: float = 0.0, tail_s: float = 0.0) -> tuple[int, ...]:
    """Split denoising steps into ``stages`` contiguous ranges minimising the slowest stage.

    ``step_costs[i]`` is the measured time of step i (CFG and SDE-window steps cost more);
    stage 0 also pays ``head_s`` (prompt encoding, initial noise), the last stage ``tail_s``
    (decoding). Returns the K+1 boundaries. Exact (DP over split points), O(K n^2).
    """
    n = len(step_costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} steps into {stages} stages")
    prefix = [0.0]
    for c in step_costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, k: int) -> float:
        return prefix[b] - prefix[a] + (head_s if k == 0 else 0.0) + (tail_s if k == stages - 1 else 0.0)

    inf = float("inf")
    # best[k][b]: minimal max stage cost covering steps [0, b) with k+1 stages.
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for b in range(1, n + 1):
        best[0][b] = cost(0, b, 0)
    for k in range(1, stages):
        for b in range(k + 1, n + 1):
            for a in range(k, b):
                v = max(best[k - 1][a], cost(a, b, k))
                if v < best[k][b]:
                    best[k][b], cut[k][b] = v, a
    bounds = [n]
    b = n
    for k in range(stages - 1, 0, -1):
        b = cut[k][b]
        bounds.append(b)
    bounds.append(0)
    return tuple(reversed(bounds))
