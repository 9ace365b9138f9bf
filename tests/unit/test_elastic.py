"""The elastic decisions as pure functions: TAG's share and TSP's stage balancing."""

from __future__ import annotations

import dataclasses

import pytest

from verl_digen.schedule.elastic import TagInputs, balance_stages, decide_tag_share, tag_decision, tag_inputs_from_costs
from verl_digen.schedule.strategies import StepCosts, StrategySpec


def _inputs(**kw) -> TagInputs:
    base = dict(
        groups_per_step=8, groups_per_task=1, rollout_workers=1, trainer_workers=1,
        rollout_generate_per_group=1.0, trainer_generate_per_group=1.0, train_per_group=0.25, switch_s=0.0,
    )
    base.update(kw)
    return TagInputs(**base)


def test_tag_assigns_nothing_when_trainers_are_the_bottleneck():
    d = decide_tag_share(_inputs(train_per_group=2.0))
    assert d.groups == 0 and d.predicted_step_s == d.predicted_step_s_without


def test_tag_assigns_nothing_when_the_switch_costs_more_than_it_saves():
    d = decide_tag_share(_inputs(switch_s=100.0))
    assert d.groups == 0


def test_tag_assigns_work_when_trainers_would_idle_and_balances_the_pools():
    inp = _inputs()
    d = decide_tag_share(inp)
    # rollout 8 groups alone: 8 s; trainer trains 8 x 0.25 = 2 s -> trainers idle 6 s.
    # n groups on trainers: rollout 8 - n, trainer n + 2 -> balanced at n = 3.
    assert d.groups == 3
    assert d.predicted_step_s == pytest.approx(5.0)
    assert d.predicted_step_s < d.predicted_step_s_without == pytest.approx(8.0)


def test_tag_share_is_whole_generate_tasks():
    d = decide_tag_share(_inputs(groups_per_task=2))
    assert d.groups % 2 == 0 and d.groups > 0


def test_slower_trainer_devices_get_a_smaller_share():
    fast = decide_tag_share(_inputs())
    slow = decide_tag_share(_inputs(trainer_generate_per_group=3.0))
    assert 0 < slow.groups < fast.groups


def test_a_share_that_leaves_some_rollout_worker_its_whole_queue_does_not_pay():
    # 4 rollout workers with 2 whole groups each; moving 1 to 3 groups leaves one of them with 2
    inp = _inputs(rollout_workers=4, trainer_workers=4, train_per_group=0.25)
    d = decide_tag_share(inp)
    assert d.groups == 4 and d.predicted_step_s == pytest.approx(1.5)  # not 3 groups (1.25 s if work were fluid)
    # in sample slices (4 per group) the rollout's queues shorten with every group moved
    sliced = decide_tag_share(dataclasses.replace(inp, rollout_split=4, tag_split=4))
    # n = 3: rollout 20 slices over 4 workers, 5 x 0.25 s; trainers 12 slices over 4, 3 x 0.25 + 8 x 0.25 / 4
    assert sliced.groups == 3 and sliced.predicted_step_s == pytest.approx(1.25)


def test_fsdp_trainers_share_in_whole_slices_per_rank_and_train_as_one_gang():
    # 2 FSDP ranks, groups of 4 in 2 slices: a unit of 1 group gives each rank one slice. The gang
    # trains a group in 0.25 s of wall time (both ranks at once), not 0.25 / 2.
    gang = _inputs(rollout_workers=2, trainer_workers=2, gang=True, share_unit=1, tag_split=2, train_per_group=0.25)
    d = decide_tag_share(gang)
    # rollout (8 - n) / 2; trainers n / 2 + 8 x 0.25 = n / 2 + 2 -> balanced at n = 2: 3 s
    assert d.groups == 2 and d.predicted_step_s == pytest.approx(3.0)
    spec = StrategySpec(placement="disaggregated", rollout_workers=2, trainer_workers=2, groups_per_step=8,
                        group_size=4, fsdp=True, tag=True)
    assert (spec.tag_split, spec.tag_unit) == (2, 1)
    # 3 ranks over groups of 4 rows: 1 slice per group (calls of 4 rows do not split in 3), 3 groups a unit
    assert StrategySpec(placement="disaggregated", rollout_workers=2, trainer_workers=3, groups_per_step=6,
                        group_size=4, train_micro_batch_groups=3, fsdp=True, tag=True).tag_unit == 3


def test_the_steady_state_prior_charges_a_gang_its_wall_time_per_group():
    spec = StrategySpec(placement="disaggregated", rollout_workers=2, trainer_workers=2, groups_per_step=8,
                        group_size=4, fsdp=True, tag=True)
    costs = StepCosts(generate_per_group=1.0, train_per_group=0.5)  # one worker's seconds per group
    assert tag_inputs_from_costs(spec, costs, 0.0).train_per_group == 0.25  # the gang: both ranks at once
    _, n = tag_decision(spec, None, 0, 0.0, measured=-1, prior=costs)  # nothing measured before step 0
    assert n == 2
    metrics, n = tag_decision(spec, None, 0, 0.0, measured=-1)  # the loop: no prior, no share
    assert n == 0 and metrics["tag/groups"] == 0


def test_balance_stages_splits_uniform_costs_evenly():
    assert balance_stages([1.0] * 9, 3) == (0, 3, 6, 9)


def test_balance_stages_gives_expensive_steps_their_own_stage():
    # CFG'd SDE-window steps (cost 3) at the start, cheap ODE steps after.
    bounds = balance_stages([3.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2)
    assert bounds == (0, 2, 8)


def test_balance_stages_accounts_for_encode_and_decode():
    assert balance_stages([1.0] * 8, 2, head_s=2.0) == (0, 3, 8)
    assert balance_stages([1.0] * 8, 2, tail_s=2.0) == (0, 5, 8)


def test_balance_stages_rejects_more_stages_than_steps():
    with pytest.raises(ValueError, match="cannot split 2 steps into 3"):
        balance_stages([1.0, 1.0], 3)


# ----------------------------------------------------------------------------- TAG's config

def _tag_config(**kw):
    from verl_digen.config.schema import digen_config_from_dict

    d = {"placement": "disaggregated", "pools": {"rollout": {"devices": 1}, "trainer": {"devices": 2}},
         "batch": {"groups_per_step": 6, "group_size": 4}, "tag": {"enable": True}}
    for key, value in kw.items():
        d[key] = {**d.get(key, {}), **value}
    return digen_config_from_dict(d)


@pytest.mark.parametrize("overrides,match", [
    (dict(tag={"groups": "half"}), "digen.tag.groups='half'; valid: auto"),
    (dict(tag={"groups": -1}), "digen.tag.groups=-1; valid: auto"),
    (dict(tag={"enable": False, "groups": 2}), "is TAG's share; set digen.tag.enable=true too"),
    (dict(tag={"groups": 8}), "at most digen.batch.groups_per_step=6"),
    (dict(tag={"groups": 3}, batch={"groups_per_task": 2}), "must be a multiple of 2 (digen.batch.groups_per_task"),
    # 3 FSDP ranks, a micro-batch of 12 rows in calls of 4: a group is one slice, 3 groups a unit
    (dict(tag={"groups": 2}, fsdp={"enable": True}, pools={"trainer": {"devices": 3}},
          batch={"train_micro_batch_groups": 3}),
     "digen.tag.groups=2; must be a multiple of 3 (whole generate tasks of digen.batch.groups_per_task=1 groups, in 1 "
     "sample slices, as many on each of the 3 FSDP trainer ranks"),
])
def test_tag_config_rules_name_their_key(overrides, match):
    from verl_digen.config.schema import ConfigError

    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        _tag_config(**overrides).validate()


def test_tag_on_fsdp_trainers_is_a_valid_config_with_a_fixed_share_in_per_rank_slices():
    cfg = _tag_config(fsdp={"enable": True}, tag={"groups": 1})
    cfg.validate()  # once refused: generation on FSDP trainers is a collective, now run in lockstep
    assert cfg.tag.fixed == 1 and cfg.tag_slices == 2  # one group: a 2-sample slice on each rank
    assert _tag_config().tag.fixed is None and _tag_config().tag_slices == 1
