"""GAT, generator-assisted training (issue 22 item 6, TAG reversed): rollout workers train some
micro-batches of a step's first PPO mini-batch with the weights they hold, which are the
trainers' then, and trainer 0 adds their LoRA gradients before its optimizer step.

- the updater: a rollout updater's gradients, added by the trainer, give the trainer's update
  (to float rounding: only the order of the sum changes);
- the plan: which micro-batches go to rollout, on which worker, and the version rule Plan.check
  enforces;
- the decision: from measured rates, 0 when it does not pay;
- the config rules, each naming its key.

Real runs on Ray workers, on-policy and one-step-off (the same final weights as without GAT):
tests/e2e/test_gat_e2e.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_digen.config.schema import AlgoConfig, ConfigError, LoraConfigSpec, digen_config_from_dict
from verl_digen.schedule.elastic import GatInputs, decide_gat_share, gat_step_time
from verl_digen.schedule.plan import Plan, PlanError, Task, TaskId, TaskKind, WorkerId
from verl_digen.schedule.strategies import StepPlanner, StrategySpec

# ----------------------------------------------------------------------------- the updater


def _updater(path, settings, images):
    from verl_digen.models.registry import load_adapter
    from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora

    adapter = load_adapter(path)
    add_lora(adapter, LoraConfigSpec(rank=4))
    return PolicyUpdater(adapter, TrainSettings(algo=AlgoConfig(lr=1e-2), sampling=settings, lora_only=True,
                                                images_per_step=images))


def test_rollout_gradients_added_by_the_trainer_give_the_trainers_update(tiny_flux):
    """Two AdamW steps of two micro-batches each: the trainer alone, or the trainer on the first
    and a second ("rollout") updater with the same weights on the second, its gradients taken
    and added by the trainer before the step. Same weights to float rounding (the sum of the
    second micro-batch's passes is formed apart, then added); the rollout updater keeps no
    gradient after the take."""
    from test_consistency import _sample, _settings

    settings = dataclasses.replace(_settings(), forward_rows=2)
    alone = _updater(tiny_flux, settings, 4)
    trainer, rollout = _updater(tiny_flux, settings, 4), _updater(tiny_flux, settings, 4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for _ in range(2):
        data = _sample(alone.adapter, settings)  # the same samples for both (the weights are equal)
        first, second = data.select_idxs([0, 1]), data.select_idxs([2, 3])
        alone.train_micro_batch(first, adv[:2])
        alone.train_micro_batch(second, adv[2:])
        alone.optimizer_step()
        trainer.train_micro_batch(first, adv[:2])
        rollout.train_micro_batch(second, adv[2:])
        grads = rollout.take_gradients()
        assert all(p.grad is None for p in rollout.params) and any(g.abs().sum() > 0 for g in grads.values())
        dropped = [p.grad.clone() for p in trainer.params]  # what the trainer would step on without them
        trainer.add_gradients(grads)
        assert any(not torch.equal(a, p.grad) for a, p in zip(dropped, trainer.params))  # the control: they count
        trainer.optimizer_step()
        with torch.no_grad():  # the weight sync: rollout receives the trainer's new version
            for p, q in zip(rollout.params, trainer.params):
                p.copy_(q)
    moved = False
    for a, b, p0 in zip(alone.params, trainer.params, _updater(tiny_flux, settings, 4).params):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
        moved |= not torch.equal(a, p0)
    assert moved  # the steps changed the weights: the comparison is not of untouched ones


def test_gradients_that_do_not_match_the_trained_parameters_are_refused(tiny_flux):
    from test_consistency import _settings

    updater = _updater(tiny_flux, _settings(), 4)
    grads = {n: torch.zeros(p.shape) for n, p in updater._named_trained().items()}
    name = next(iter(grads))
    with pytest.raises(RuntimeError, match="missing"):
        updater.add_gradients({k: v for k, v in grads.items() if k != name})
    with pytest.raises(RuntimeError, match=f"gradient of {name} has shape"):
        updater.add_gradients(dict(grads, **{name: torch.zeros(1)}))


# ----------------------------------------------------------------------------- the plan


def _spec(**kw) -> StrategySpec:
    base = dict(placement="disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=8, group_size=4,
                gap=True, gat=True, train_micro_batch_groups=2)
    return StrategySpec(**{**base, **kw})


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_last_micro_batches_of_the_first_mini_batch_go_to_the_rollout_workers_in_turn(staleness):
    planner = StepPlanner(_spec(max_staleness=staleness, mini_batches=2))
    for step in range(3):
        planner.plan_step(step, gat_micro_batches=step)  # 0, 1, then 2 (= the whole first mini-batch)
    planner.plan.check(complete_steps=range(3))
    on_rollout = {t.id: t.worker for t in planner.plan.tasks if t.kind == TaskKind.TRAIN and t.worker.pool == "rollout"}
    assert on_rollout == {TaskId.train(1, 1): WorkerId("rollout", 1),
                          TaskId.train(2, 0): WorkerId("rollout", 0), TaskId.train(2, 1): WorkerId("rollout", 1)}
    # the first mini-batch's optimizer step waits for them; the second mini-batch stays on the trainer
    opt = planner.plan[TaskId.optimizer_step(2, 0)]
    assert {TaskId.train(2, 0), TaskId.train(2, 1)} <= set(opt.deps)
    assert all(planner.plan[TaskId.train(2, j)].worker == WorkerId("trainer", 0) for j in (2, 3))


def test_more_micro_batches_than_the_first_mini_batch_are_capped_and_gat_off_refuses_a_share():
    planner = StepPlanner(_spec(mini_batches=2))
    planner.plan_step(0, gat_micro_batches=5)
    assert sum(t.worker.pool == "rollout" for t in planner.plan.of_kind(TaskKind.TRAIN)) == 2
    with pytest.raises(ValueError, match="gat=True"):
        StepPlanner(_spec(gat=False)).plan_step(0, gat_micro_batches=1)


def _hand_plan(train_on: WorkerId, *, mini_batch: int, sync_first: bool) -> Plan:
    """Step 1 of a plan whose rollout worker holds version 0 (no sync) or 1 (sync first)."""
    r, t = WorkerId("rollout", 0), WorkerId("trainer", 0)
    plan = Plan(workers=[r, t], start_version=0)
    plan.add(Task(TaskId.generate((0,)), TaskKind.GENERATE, (r,), step=0, groups=(0,), version=0))
    plan.add(Task(TaskId.reward((0,)), TaskKind.REWARD, (r,), step=0, deps=(TaskId.generate((0,)),), groups=(0,)))
    plan.add(Task(TaskId.train(0, 0), TaskKind.TRAIN, (t,), step=0, deps=(TaskId.reward((0,)),), groups=(0,)))
    plan.add(Task(TaskId.optimizer_step(0), TaskKind.OPTIMIZER_STEP, (t,), step=0, deps=(TaskId.train(0, 0),), version=1))
    if sync_first:
        plan.add(Task(TaskId.sync(1), TaskKind.SYNC, (r,), step=0, deps=(TaskId.optimizer_step(0),), version=1))
    plan.add(Task(TaskId.generate((1,)), TaskKind.GENERATE, (r,), step=1, groups=(1,), version=1 if sync_first else 0))
    plan.add(Task(TaskId.reward((1,)), TaskKind.REWARD, (r,), step=1, deps=(TaskId.generate((1,)),), groups=(1,)))
    plan.add(Task(TaskId.train(1, 0), TaskKind.TRAIN, (train_on,), step=1, deps=(TaskId.reward((1,)),), groups=(1,),
                  mini_batch=mini_batch))
    plan.add(Task(TaskId.optimizer_step(1), TaskKind.OPTIMIZER_STEP, (t,), step=1, deps=(TaskId.train(1, 0),),
                  version=2, mini_batch=mini_batch))
    return plan


def test_plan_check_refuses_rollout_training_off_the_trainers_version():
    r = WorkerId("rollout", 0)
    plan = _hand_plan(r, mini_batch=0, sync_first=True)
    plan.max_staleness = 1
    plan.check()  # version 1 on both sides: valid
    stale = _hand_plan(r, mini_batch=0, sync_first=False)
    stale.max_staleness = 1
    with pytest.raises(PlanError, match="holds version 0"):
        stale.check()
    later = _hand_plan(r, mini_batch=1, sync_first=True)
    later.max_staleness = 1
    with pytest.raises(PlanError, match="first mini-batch"):
        later._check_versions()


# ----------------------------------------------------------------------------- the decision


def _inputs(**kw) -> GatInputs:
    base = dict(groups_per_step=8, train_micro_batch_groups=1, first_mini_batch=8, rollout_workers=2,
                trainer_workers=1, rollout_generate_per_group=1.0, train_per_group=2.0, rollout_train_per_group=2.0)
    return GatInputs(**{**base, **kw})


def test_trainer_bound_steps_move_micro_batches_to_rollout_until_the_pools_balance():
    inp = _inputs()  # rollout 8 x 1 / 2 = 4 s; trainer 8 x 2 = 16 s
    d = decide_gat_share(inp)
    # n on rollout: rollout 4 + ceil(n/2) x 2, trainer (8 - n) x 2: balanced at n = 4 (8 s each)
    assert d.micro_batches == 4 and d.predicted_step_s == pytest.approx(8.0)
    assert d.predicted_step_s_without == pytest.approx(16.0) == gat_step_time(inp, 0)
    metrics = d.as_metrics(inp)
    assert metrics["gat/micro_batches"] == 4.0 and metrics["gat/train_per_group"] == 2.0


def test_rollout_bound_steps_or_slow_rollout_training_assign_nothing():
    assert decide_gat_share(_inputs(rollout_generate_per_group=5.0)).micro_batches == 0  # rollout is the bottleneck
    slow = decide_gat_share(_inputs(rollout_workers=1, rollout_generate_per_group=1.9, train_per_group=1.0,
                                    rollout_train_per_group=50.0))
    assert slow.micro_batches == 0 and slow.predicted_step_s == slow.predicted_step_s_without


def test_fsdp_trainers_count_every_micro_batch_and_a_later_mini_batch_waits_for_the_first():
    """FSDP: each micro-batch takes the whole gang, so the trainers' time is every micro-batch
    they keep; 2 PPO mini-batches without TCSS: the rollout trains only after generating, and the
    second mini-batch waits for the first's step, which waits for the rollout: no share pays
    (rollout 2 workers, 8 groups of 1.5 s, training 2 s a group: 16 s whatever n)."""
    gang = _inputs(trainer_workers=4, gang=True, train_per_group=0.5, rollout_generate_per_group=0.1)  # 8 x 0.5: 4 s
    assert gat_step_time(gang, 0) == pytest.approx(4.0)
    assert gat_step_time(dataclasses.replace(gang, gang=False), 0) == pytest.approx(1.0)  # 2 each on 4 trainers
    barrier = _inputs(first_mini_batch=4, rollout_generate_per_group=1.5)
    assert [gat_step_time(barrier, n) for n in range(4)] == pytest.approx([16.0, 16.0, 16.0, 18.0])
    assert decide_gat_share(barrier).micro_batches == 0
    # under TCSS the rollout trains first (before the next step's groups): then it pays
    ahead = dataclasses.replace(barrier, lookahead=True)
    assert gat_step_time(ahead, 2) == pytest.approx(max(6 + 2, max(2 * 2, 2) + 8))  # 12 s
    assert gat_step_time(ahead, 0) == pytest.approx(16.0) and decide_gat_share(ahead).micro_batches > 0


def test_measured_rates_count_a_group_once_across_its_tsp_stages_and_a_gangs_rate_per_rank():
    from verl_digen.schedule.elastic import gat_inputs_from_timeline
    from verl_digen.schedule.timeline import TaskRecord, Timeline

    spec = _spec(rollout_workers=2, trainer_workers=2, fsdp=True, tsp_stages=2, num_steps=8)
    records = [TaskRecord(f"gen:{g}:s{k}", "generate", [f"rollout{k}"], 0.0, 1.0, 0, 0, [g], stage=k)
               for g in range(8) for k in range(2)]
    records += [TaskRecord(f"train:0:{j}", "train", ["trainer0", "trainer1"], 0.0, 3.0, 0, 0, [2 * j, 2 * j + 1])
                for j in range(4)]
    timeline = Timeline(workers=["rollout0", "rollout1", "trainer0", "trainer1"])
    for r in records:
        timeline.add(r)
    inp = gat_inputs_from_timeline(spec, timeline, 0)
    assert inp.rollout_generate_per_group == 2.0  # two 1 s stages per group, not 1 s
    assert inp.train_per_group == 1.5 and inp.gang
    assert inp.rollout_train_per_group == 3.0  # unsharded: the gang's rate over its 2 ranks


# ----------------------------------------------------------------------------- the config


@pytest.mark.parametrize("overrides,match", [
    (dict(placement="colocated"), "digen.gat.enable=True; GAT needs digen.placement=disaggregated"),
    (dict(model=dict(lora=dict(enable=False))), "needs digen.model.lora.enable=true"),
    (dict(tag=dict(enable=True)), "GAT cannot be combined with TAG (the opposite direction); turn off digen.tag.enable"),
    (dict(tsp=dict(train_split="timestep")), "needs digen.tsp.train_split=sample"),
    (dict(gat=dict(enable=True, micro_batches=5), batch=dict(groups_per_step=8, mini_batches_per_step=2)),
     "digen.gat.micro_batches=5; at most the 4 micro-batches"),
    (dict(gat=dict(enable=True, micro_batches="half")), "digen.gat.micro_batches='half'; valid: auto"),
    (dict(gat=dict(enable=False, micro_batches=2)), "set digen.gat.enable=true too"),
    (dict(gat=dict(enable=True, micro_batches=0)), "digen.gat.micro_batches=0; assigns nothing every step"),
])
def test_gat_config_rules_name_their_key(overrides, match):
    d = {"placement": "disaggregated", "gat": {"enable": True}, **overrides}
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        digen_config_from_dict(d).validate()


def test_a_valid_gat_config_passes_and_fixes_its_share():
    cfg = digen_config_from_dict({"placement": "disaggregated", "gat": {"enable": True, "micro_batches": 1}})
    cfg.validate()
    assert cfg.gat.fixed == 1 and cfg.strategy_fields()["gat"] is True
    auto = digen_config_from_dict({"placement": "disaggregated", "gat": {"enable": True}})
    auto.validate()
    assert auto.gat.fixed is None
