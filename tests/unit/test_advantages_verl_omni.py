"""veRL-Omni's advantage options: the formula of each (``algorithm.global_std``,
``algorithm.norm_adv_by_std_in_grpo``, veRL-Omni's std of the rewards repeated over the recorded
SDE steps) against advantages computed here with NumPy from its definition, and the std_mode /
std_estimator each spelling of a run's keys gives under main_ppo (veRL-Omni's defaults for a
veRL-Omni recipe, veRL's for a veRL job; contradictions refused). DanceGRPO: test_dance_grpo.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from test_omni_keys import _verl_config
from verl_digen.algos.advantages import group_advantages, run_std_correction, std_correction
from verl_digen.config.omni_keys import plain_overrides
from verl_digen.config.schema import ConfigError, DigenConfig, digen_config_from_dict
from verl_digen.config.verl_keys import MAIN_PPO, override_keys, resolve_run_config

ARR = "actor_rollout_ref"
EPS = 1e-4  # veRL-Omni's epsilon (compute_flow_grpo_outcome_advantage) and Flow-GRPO's

# 3 groups of 4 rewards (group labels not sorted), T = 3 recorded SDE steps
REWARDS = np.array([0.3, 1.2, -0.4, 0.9, 2.0, 2.5, 1.1, 0.05, -1.0, 0.7, 0.7, 3.3])
GROUPS = np.array([5, 5, 5, 5, 2, 2, 2, 2, 9, 9, 9, 9])
T = 3


def _verl_omni(rewards, groups, steps, norm_adv_by_std_in_grpo=True, global_std=True):
    """veRL-Omni's definition, as its trainer runs it: each reward repeated over the ``steps``
    columns of old_log_probs, the group's mean, and torch.std (ddof=1) of the [n, steps] block of
    the batch (global_std) or of the group."""
    scores = np.repeat(rewards[:, None], steps, axis=1)
    out = np.empty_like(rewards)
    batch_std = scores.std(ddof=1)
    for i, g in enumerate(groups):
        block = scores[groups == g]
        centred = rewards[i] - block.mean()
        std = batch_std if global_std else block.std(ddof=1)
        out[i] = centred / (std + EPS) if norm_adv_by_std_in_grpo else centred
    return out


def _ours(std_mode, correction):
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS), std_mode=std_mode,
                           correction=correction)
    return adv.numpy()


def test_global_std_true_is_the_batch_std_of_the_rewards_repeated_over_the_steps():
    expected = _verl_omni(REWARDS, GROUPS, T, global_std=True)
    np.testing.assert_allclose(_ours("global", std_correction("verl_omni", T)), expected, rtol=1e-12)
    # not the population std (Flow-GRPO's): the two differ here
    assert not np.allclose(_ours("global", 0.0), expected, rtol=1e-6)


def test_global_std_false_is_the_group_std_of_the_rewards_repeated_over_the_steps():
    expected = _verl_omni(REWARDS, GROUPS, T, global_std=False)
    np.testing.assert_allclose(_ours("group", std_correction("verl_omni", T)), expected, rtol=1e-12)
    assert not np.allclose(_ours("group", 0.0), expected, rtol=1e-4)  # G=4, T=3: sqrt(12/11)


def test_norm_adv_by_std_false_only_centres_whatever_global_std_says():
    for global_std in (True, False):
        expected = _verl_omni(REWARDS, GROUPS, T, norm_adv_by_std_in_grpo=False, global_std=global_std)
        np.testing.assert_allclose(_ours("none", std_correction("verl_omni", T)), expected, rtol=1e-12)


def test_population_estimator_is_flow_grpos_numpy_std():
    groups = sorted(set(GROUPS))
    expected = np.empty_like(REWARDS)
    for g in groups:
        r = REWARDS[GROUPS == g]
        expected[GROUPS == g] = (r - r.mean()) / (r.std() + EPS)
    np.testing.assert_allclose(_ours("group", std_correction("population", T)), expected, rtol=1e-12)
    expected_global = np.array([REWARDS[i] - REWARDS[GROUPS == g].mean() for i, g in enumerate(GROUPS)])
    np.testing.assert_allclose(_ours("global", 0.0), expected_global / (REWARDS.std() + EPS), rtol=1e-12)


def test_one_recorded_step_is_bessels_correction_and_bad_values_are_refused():
    np.testing.assert_allclose(_ours("global", std_correction("verl_omni", 1)),
                               _verl_omni(REWARDS, GROUPS, 1), rtol=1e-12)
    with pytest.raises(ValueError, match="correction=1.5 must be in"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), correction=1.5)
    with pytest.raises(ValueError, match="std_estimator='bessel'"):
        std_correction("bessel", 3)


@pytest.mark.parametrize(("window", "steps"), [
    ({}, 8),  # every step of the default 8 is an SDE step
    ({"mode": "random", "size": 2, "start": 0, "range_end": 4}, 2),
    ({"mode": "fixed", "size": 0, "start": 3}, 5),
])
def test_the_runs_correction_is_one_over_the_steps_its_window_records(window, steps):
    cfg = DigenConfig()
    for name, value in window.items():
        setattr(cfg.sampling.sde_window, name, value)
    assert run_std_correction(cfg) == 0.0  # the default estimator: population
    cfg.algo.std_estimator = "verl_omni"
    assert run_std_correction(cfg) == pytest.approx(1 / steps)


def test_the_executor_normalises_with_the_runs_correction():
    """RayPlanExecutor.advantages (what every train task gets): group and global std with the
    correction it was built with."""
    from types import SimpleNamespace

    from verl_digen.trainer.ray_executor import RayPlanExecutor

    rewards = {int(g): torch.tensor(REWARDS[GROUPS == g]) for g in sorted(set(GROUPS))}
    for std_mode, global_std in (("group", False), ("global", True)):
        ex = RayPlanExecutor.__new__(RayPlanExecutor)
        ex.std_mode, ex.std_correction = std_mode, 1 / T
        ex.results = {0: SimpleNamespace(rewards=rewards)}
        got = ex.advantages(SimpleNamespace(step=0, groups=[9, 2])).numpy()
        order = np.concatenate([np.flatnonzero(GROUPS == 9), np.flatnonzero(GROUPS == 2)])
        expected = _verl_omni(REWARDS, GROUPS, T, global_std=global_std)[order]
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def _run(*overrides: str, digen: bool = False):
    """main_ppo's config for the overrides (veRL's ppo_trainer, the plugin's rewrite of veRL-Omni's keys)."""
    argv = plain_overrides(["trainer.v1.trainer_mode=digen", *overrides])
    config = OmegaConf.to_container(_verl_config(argv), resolve=True)
    return digen_config_from_dict(resolve_run_config(config, MAIN_PPO, override_keys(argv)).digen)


OMNI = f"{ARR}.rollout.pipeline.height=64"  # any veRL-Omni diffusion key makes the run a veRL-Omni recipe


@pytest.mark.parametrize(("overrides", "std_mode", "estimator"), [
    ((), "group", "population"),  # a veRL job: veRL's group std, Flow-GRPO's estimator
    (("algorithm.adv_estimator=grpo",), "group", "population"),
    (("algorithm.norm_adv_by_std_in_grpo=false",), "none", "population"),
    ((OMNI,), "global", "verl_omni"),  # veRL-Omni's default global_std=true, no key written
    (("algorithm.adv_estimator=flow_grpo",), "global", "verl_omni"),
    ((f"{ARR}.model.algorithm=flow_grpo",), "global", "verl_omni"),
    ((OMNI, "algorithm.global_std=true"), "global", "verl_omni"),
    ((OMNI, "algorithm.global_std=false"), "group", "verl_omni"),
    ((OMNI, "+algorithm.global_std=False"), "group", "verl_omni"),  # veRL-Omni's bagel recipes' spelling
    (("algorithm.adv_estimator=flow_grpo", "algorithm.norm_adv_by_std_in_grpo=false"), "none", "verl_omni"),
    ((OMNI, "algorithm.norm_adv_by_std_in_grpo=false", "algorithm.global_std=false"), "none", "verl_omni"),
    ((f"{ARR}.model.algorithm=dance_grpo",), "global", "verl_omni"),
    ((f"{ARR}.model.algorithm=dance_grpo", "algorithm.adv_estimator=flow_grpo", "algorithm.global_std=false"),
     "group", "verl_omni"),  # the flow_grpo estimator honours the key, as in veRL-Omni
    ((OMNI, "+digen.algo.std_mode=group"), "group", "verl_omni"),  # a digen key written wins over the default
    ((OMNI, "+digen.algo.std_estimator=population"), "global", "population"),
    ((f"{ARR}.model.attn_backend=native",), "group", "population"),  # a kernel choice is no recipe
])
def test_each_spelling_gives_its_std_mode_and_estimator(overrides, std_mode, estimator):
    cfg = _run(*overrides)
    assert (cfg.algo.std_mode, cfg.algo.std_estimator) == (std_mode, estimator)


@pytest.mark.parametrize(("overrides", "message"), [
    ((OMNI, "algorithm.norm_adv_by_std_in_grpo=false", "algorithm.global_std=true"),
     r"algorithm.global_std=True cannot apply: algorithm.norm_adv_by_std_in_grpo=false divides by no std"),
    (("algorithm.global_std=true", "algorithm.adv_estimator=grpo"),
     r"algorithm.global_std=True cannot apply: it is veRL-Omni's .* use digen.algo.std_mode=global"),
    ((OMNI, "+digen.gap.enable=true"),
     r"algorithm.global_std=True cannot apply: true \(veRL-Omni's default when unset\) .* set "
     r"algorithm.global_std=false .* or digen.gap.enable=false"),
    ((OMNI, "algorithm.global_std=false", "+digen.algo.std_mode=none"),
     r"algorithm.global_std=False and digen.algo.std_mode='none' are the same setting"),
    ((f"{ARR}.model.algorithm=dance_grpo", "algorithm.global_std=false"),
     r"algorithm.global_std=False cannot apply: veRL-Omni's dance_grpo ignores it"),
    (("algorithm.adv_estimator=dance_grpo", "algorithm.norm_adv_by_std_in_grpo=false"),
     r"algorithm.norm_adv_by_std_in_grpo=False cannot apply: veRL-Omni's dance_grpo ignores it"),
    ((OMNI, "algorithm.global_std=maybe"), r"algorithm.global_std='maybe' cannot apply: must be true or false"),
])
def test_contradictory_or_inapplicable_advantage_keys_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as stopped:
        _run(*overrides)
    assert "\n" not in str(stopped.value)


def test_gap_with_the_groups_std_is_accepted_for_a_verl_omni_recipe():
    cfg = _run(OMNI, "algorithm.global_std=false", "+digen.gap.enable=true", "+digen.placement=disaggregated")
    assert (cfg.algo.std_mode, cfg.gap.enable) == ("group", True)
