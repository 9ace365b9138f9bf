"""Per-step decisions from measured rates: TAG's share and TSP's stage boundaries."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TagInputs:
    """Measured seconds per group (per worker) and pool sizes for one step."""

    groups_per_step: int
    groups_per_task: int
    rollout_workers: int
    trainer_workers: int
    rollout_generate_per_group: float  # one rollout worker
    trainer_generate_per_group: float  # one trainer worker
    train_per_group: float  # one trainer rank
    switch_s: float  # a trainer switching from generating to training (once per step)


@dataclass(frozen=True)
class TagDecision:
    groups: int
    predicted_step_s: float
    predicted_step_s_without: float
    reason: str

    def as_metrics(self, inputs: TagInputs | None) -> dict[str, float]:
        m = {
            "tag/groups": float(self.groups),
            "tag/predicted_step_s": self.predicted_step_s,
            "tag/predicted_step_s_without": self.predicted_step_s_without,
        }
        if inputs is not None:
            m.update({f"tag/{k}": float(v) for k, v in asdict(inputs).items()})
        return m


def tag_inputs_from_timeline(spec, timeline, step: int, switch_s: float) -> TagInputs | None:
    """TAG's inputs for the step after ``step``, from a :class:`Timeline`'s records of ``step``.

    Per-group seconds on one worker: rollout generation, training (all parts summed), and
    trainer generation (the latest step where trainers generated; until then the rollout
    rate, i.e. the same device type). None when ``step`` measured nothing yet.
    """

    def per_group(kind: str, at: int, pool: str | None) -> float | None:
        rs = [r for r in timeline.of_step(at) if r.kind == kind and (pool is None or r.workers[0].startswith(pool))]
        groups = {g for r in rs for g in r.groups}
        return sum(r.end - r.start for r in rs) / len(groups) if groups else None

    if step < 0:
        return None
    roll = per_group("generate", step, "rollout")
    train = per_group("train", step, None)
    if roll is None or train is None:
        return None
    trainer_gen = next((v for v in (per_group("generate", q, "trainer") for q in range(step, -1, -1)) if v is not None), roll)
    return TagInputs(
        groups_per_step=spec.groups_per_step,
        groups_per_task=spec.groups_per_task,
        rollout_workers=spec.rollout_workers,
        trainer_workers=spec.trainer_workers,
        rollout_generate_per_group=roll,
        trainer_generate_per_group=trainer_gen,
        train_per_group=train,
        switch_s=switch_s,
    )


def _phase_time(inp: TagInputs, n: int) -> float:
    """Time until both pools are done with the step's generation-and-training work.

    Rollout generates ``G - n`` groups; trainers generate ``n`` (plus one switch) and train
    all ``G``. The step cannot end before the slower of the two pools.
    """
    g = inp.groups_per_step
    rollout = (g - n) * inp.rollout_generate_per_group / inp.rollout_workers
    trainer = n * inp.trainer_generate_per_group / inp.trainer_workers + (inp.switch_s if n else 0.0)
    trainer += g * inp.train_per_group / inp.trainer_workers
    return max(rollout, trainer)


def decide_tag_share(inp: TagInputs) -> TagDecision:
    """How many of the step's groups the trainers should generate (whole tasks only).

    Chooses the share that minimises the step's predicted time, i.e. that makes both pools
    finish together; assigns nothing unless that strictly beats not assisting (e.g. when the
    trainers are already the bottleneck, or switching costs more than it saves).
    """
    without = _phase_time(inp, 0)
    best_n, best_t = 0, without
    for n in range(inp.groups_per_task, inp.groups_per_step + 1, inp.groups_per_task):
        t = _phase_time(inp, n)
        if t < best_t - 1e-12:
            best_n, best_t = n, t
    if best_n == 0:
        reason = "assisting does not pay: trainers are the bottleneck or the switch costs more than it saves"
    else:
        reason = "trainers generate while they would otherwise wait for the first groups"
    return TagDecision(groups=best_n, predicted_step_s=best_t, predicted_step_s_without=without, reason=reason)


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
