"""The elastic decisions as pure functions: TAG's share and TSP's stage balancing."""

from __future__ import annotations

import pytest

from verl_digen.schedule.elastic import TagInputs, balance_stages, decide_tag_share


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
