"""PPO mini-batches (veRL's ``ppo_mini_batch_size < train_batch_size``): several optimizer
steps per rollout batch. Versions count rollout batches (docs/decisions.md): only a step's
last mini-batch makes the next version, so TCSS staleness stays within one rollout batch. The
second mini-batch on a GPU in bf16: tests/gpu/test_mini_batches_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_digen.schedule.plan import Plan, PlanError, Task, TaskId, TaskKind
from verl_digen.schedule.strategies import StepPlanner, StrategySpec


def _plan(spec: StrategySpec, steps: int = 3) -> Plan:
    planner = StepPlanner(spec)
    for s in range(steps):
        planner.plan_step(s, has_next=s + 1 < steps)
    planner.plan.check(complete_steps=range(steps))
    return planner.plan


TCSS_GAP = StrategySpec("disaggregated", rollout_workers=2, trainer_workers=2, groups_per_step=4, group_size=2,
                        gap=True, max_staleness=1, mini_batches=2)


def test_two_mini_batches_give_two_optimizer_steps_and_one_version_per_step():
    plan = _plan(TCSS_GAP)
    for s in range(3):
        opts = plan.of_kind(TaskKind.OPTIMIZER_STEP, s)
        assert [str(o.id) for o in opts] == [f"opt:{s}:m0", f"opt:{s}"]
        assert [o.version for o in opts] == [s, s + 1]  # only the last makes a version
    assert [t.version for t in plan.of_kind(TaskKind.SYNC)] == [1, 2, 3]  # one sync per rollout batch


def test_with_gap_a_mini_batch_steps_when_its_own_groups_are_in():
    plan = _plan(TCSS_GAP, steps=1)
    first = plan[TaskId.optimizer_step(0, 0)]
    trains = {t.id: t for t in plan.of_kind(TaskKind.TRAIN, 0)}
    # mini-batch 0 = the first two groups rewarded; its step waits for no reward of the other two
    assert sorted(g for d in first.deps for g in trains[d].groups) == [0, 1]
    rewards_waited = {d for d in first.deps for d in trains[d].deps}
    assert rewards_waited == {TaskId.reward((0,)), TaskId.reward((1,))}
    # mini-batch 1 trains on the weights mini-batch 0's step made
    assert all(first.id in t.deps for t in trains.values() if t.mini_batch == 1)


def test_tcss_staleness_counts_rollout_batches_never_more_than_one_behind():
    plan = _plan(TCSS_GAP, steps=4)
    gens = plan.of_kind(TaskKind.GENERATE)
    assert {t.step - t.version for t in gens} == {0, 1}  # the one-step-off pipeline, not k steps off
    for s in range(1, 4):  # step s's groups were generated ahead on version s - 1, while step s - 1 trained
        assert {t.version for t in gens if t.step == s} == {s - 1}


def test_plan_check_refuses_generating_between_mini_batches():
    spec = StrategySpec("colocated", rollout_workers=1, trainer_workers=1, groups_per_step=2, group_size=2,
                        mini_batches=2)
    plan = _plan(spec, steps=1)
    fused = spec.trainers[0]
    bad = Plan(workers=plan.workers, max_staleness=0)
    for t in plan.tasks:
        bad.add(t)
        if t.id == TaskId.optimizer_step(0, 0):  # a generate slipped between the two mini-batches
            bad.add(Task(id=TaskId.generate((99,)), kind=TaskKind.GENERATE, workers=(fused,), step=1, groups=(99,),
                         version=0))
    with pytest.raises(PlanError, match="between two mini-batches"):
        bad._check_versions()


def test_plan_check_refuses_a_mini_batch_that_does_not_wait_for_the_previous_step():
    plan = _plan(dataclasses.replace(TCSS_GAP, max_staleness=0), steps=1)
    bad = Plan(workers=plan.workers)
    for t in plan.tasks:
        if t.kind == TaskKind.TRAIN and t.mini_batch == 1:
            t = dataclasses.replace(t, deps=tuple(d for d in t.deps if d.kind != TaskKind.OPTIMIZER_STEP))
        bad.add(t)
    with pytest.raises(PlanError, match="does not wait for opt:0:m0"):
        bad.check()


@pytest.mark.parametrize("kwargs, field", [
    ({"groups_per_step": 4, "mini_batches": 3}, "mini_batches"),
    ({"groups_per_step": 4, "mini_batches": 2, "train_micro_batch_groups": 4}, "train_micro_batch_groups"),
])
def test_mini_batches_must_split_the_step_into_whole_micro_batches(kwargs, field):
    with pytest.raises(ValueError, match=f"{field}="):
        StrategySpec("disaggregated", rollout_workers=1, trainer_workers=1, group_size=2, **kwargs)


# ----------------------------------------------------------------------------- the simulator and cost model


def _flux(**workload):
    from verl_digen.sim.cost_model import CostModel, load_catalog

    return CostModel.from_catalog(load_catalog(), "flux-12b", devices=["H800"], **workload)


def test_the_simulator_charges_one_optimizer_step_per_mini_batch():
    from verl_digen.sim.cost_model import Cluster
    from verl_digen.sim.simulator import simulate

    one = StrategySpec("disaggregated", rollout_workers=4, trainer_workers=4, groups_per_step=8, group_size=8,
                       gap=True, max_staleness=1, fsdp=True)
    two = dataclasses.replace(one, mini_batches=2)
    cluster = Cluster.for_spec(one, "H800")
    costs = _flux()
    runs = {s.mini_batches: simulate(s, costs, cluster, steps=3, warmup=1) for s in (one, two)}
    per_step = {}
    for k, run in runs.items():
        opts = [r for r in run.timeline.records if r.kind == "optimizer_step" and r.step == 1]
        assert len({r.task for r in opts}) == k  # the optimizer steps of step 1, one per mini-batch
        per_step[k] = sum(r.end - r.start for r in opts)
    model = costs.for_spec(two)
    dev, group = model.device("H800"), model.train_group(cluster)
    assert model.workload.mini_batches == 2 and model.workload.optimizer_tasks == 2
    # mini-batch 0's step is one Adam update (and, with the trainers' optimizer state parked, as
    # here where that spares checkpointing, its host round trip); the last adds the per-version work once
    trip = 2 * model.optimizer_shard_bytes(group) / (dev.host_link_gbps * 1e9) if model.optimizer_parked(dev, group) else 0.0
    assert model.optimizer_task_seconds(dev, group, 0) == pytest.approx(model.update_seconds(dev, group) + trip)
    assert model.optimizer_task_seconds(dev, group, 0) + model.optimizer_task_seconds(dev, group, 1) == \
        pytest.approx(model.optimizer_seconds(dev, group))
    # two mini-batches cost exactly one more update (and one more task, and round trip) than one
    extra = model.update_seconds(dev, group) + model.system.task_overhead_s + trip
    assert per_step[2] - per_step[1] == pytest.approx(extra, rel=1e-6)


def test_the_emulated_worker_steps_per_mini_batch_and_versions_per_step():
    from verl_digen.sim.cost_model import Cluster, PoolPlacement
    from verl_digen.schedule.plan import WorkerId
    from verl_digen.workers.emulated import EmulatedWorker
    from verl_digen.workers.messages import OptimizerRequest

    spec = StrategySpec("disaggregated", rollout_workers=1, trainer_workers=1, groups_per_step=2, group_size=2,
                        mini_batches=2)
    costs = _flux(groups_per_step=2, group_size=2).for_spec(spec)
    cluster = Cluster({"rollout": PoolPlacement(1, 1, "H800"), "trainer": PoolPlacement(1, 1, "H800")})
    w = EmulatedWorker(WorkerId("trainer", 0), costs, cluster, group_size=2, time_scale=0.0)
    assert w.optimizer_step(OptimizerRequest(mini_batch=0, final=False)).policy_version == 0
    assert w.optimizer_step(OptimizerRequest(mini_batch=1, final=True)).policy_version == 1
    charged = [s for kind, _, s in w.charged if kind == "optimizer_step"]
    dev, group = costs.device("H800"), costs.train_group(cluster)
    overhead = costs.system.task_overhead_s
    assert charged[0] == pytest.approx(costs.optimizer_task_seconds(dev, group, 0) + overhead)
    assert charged[1] == pytest.approx(costs.optimizer_task_seconds(dev, group, 1) + overhead
                                       + costs.snapshot_seconds(dev, cluster))


# ----------------------------------------------------------------------------- the numerics (tiny model)


def _two_mini_batches(adapter, device: str = "cpu"):
    """Sample two groups of 2 with ``adapter``, then train them as two PPO mini-batches of one
    group each (an optimizer step after each), as the worker does; the metrics of both."""
    from test_consistency import _sample, _settings
    from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
    from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora

    add_lora(adapter, LoraConfigSpec(rank=4))
    settings = _settings()
    data = _sample(adapter, settings)
    rows = data.non_tensor_batch["group_id"]
    updater = PolicyUpdater(adapter, TrainSettings(algo=AlgoConfig(lr=0.5), sampling=settings, lora_only=True,
                                                   images_per_step=2))  # one mini-batch: one group of 2
    out = []
    for g in (0, 1):
        idx = [i for i, r in enumerate(rows) if int(r) == g]
        out.append(updater.train_micro_batch(data.select_idxs(idx), torch.tensor([1.0, -1.0])))
        out[-1].update(updater.optimizer_step())
    return out


def test_the_second_mini_batch_trains_against_the_behaviour_log_probs(tiny_flux):
    """Mini-batch 0 is on-policy (ratio exactly 1, nothing clipped); mini-batch 1 runs on the
    weights mini-batch 0's step made, against the log-probs recorded at rollout: its ratio
    moves and, with a large learning rate and Flow-GRPO's small clip range, clips."""
    from verl_digen.models.registry import load_adapter

    first, second = _two_mini_batches(load_adapter(tiny_flux))
    assert abs(first["actor/ratio_mean"] - 1.0) < 1e-5 and first["actor/clip_frac"] == 0.0
    assert abs(second["actor/ratio_mean"] - 1.0) > 1e-4
    assert second["actor/clip_frac"] > 0.0
