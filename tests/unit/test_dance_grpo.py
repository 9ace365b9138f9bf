"""veRL-Omni's dance_grpo: what its pipeline adapters do differently from flow_grpo (DanceGRPO's
time-shifted sigmas, the same initial noise for a group) done when the key says dance_grpo, its
keys mapped, and its advantages (veRL-Omni ignores global_std there). The DanceGRPO SDE step
against hand-computed values: test_algos_sde.py (sde_type dance_sde); the advantage formulas:
test_advantages_verl_omni.py."""

from __future__ import annotations

import dataclasses
import shlex

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from test_omni_keys import _verl_config
from verl_digen.algos.sde import time_shift_sigmas
from verl_digen.config.omni_keys import plain_overrides
from verl_digen.config.schema import ConfigError, DigenConfig, digen_config_from_dict
from verl_digen.config.verl_keys import MAIN_PPO, override_keys, resolve_run_config

ARR = "actor_rollout_ref"

# veRL-Omni's examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_auto.sh, its algorithm and
# diffusion keys as shipped (the data, model, engine and environment keys left out; its
# pipeline.num_frames=8, rounded as diffusers rounds it: test_omni_defaults).
WAN22_DANCE = """
    algorithm.adv_estimator=dance_grpo actor_rollout_ref.model.algorithm=dance_grpo
    actor_rollout_ref.actor.diffusion_loss.loss_mode=dance_grpo
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.pipeline.true_cfg_scale=5.0
    actor_rollout_ref.rollout.pipeline.num_inference_steps=10
    actor_rollout_ref.rollout.algo.noise_level=1.2 actor_rollout_ref.rollout.algo.sde_type="dance_sde"
    actor_rollout_ref.rollout.algo.sde_window_size=2 actor_rollout_ref.rollout.algo.sde_window_range="[0,5]"
    actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=50
    actor_rollout_ref.rollout.val_kwargs.algo.noise_level=0.0
"""


def _run(*overrides: str) -> DigenConfig:
    argv = plain_overrides(["trainer.v1.trainer_mode=digen", *overrides])
    config = OmegaConf.to_container(_verl_config(argv), resolve=True)
    return digen_config_from_dict(resolve_run_config(config, MAIN_PPO, override_keys(argv)).digen)


def test_verl_omnis_dance_grpo_recipe_maps_onto_danceGRPOs_sampling_and_advantages():
    cfg = _run(*shlex.split(WAN22_DANCE))
    s = cfg.sampling
    assert (s.time_shift, s.same_initial_noise) == (5.0, True)
    assert (s.sde_type, s.noise_level, s.num_steps, s.guidance_scale) == ("dance_sde", 1.2, 10, 5.0)
    assert (s.sde_window.mode, s.sde_window.size, s.sde_window.start, s.sde_window.range_end) == ("random", 2, 0, 4)
    assert (cfg.algo.std_mode, cfg.algo.std_estimator) == ("global", "verl_omni")
    assert cfg.validation.num_steps == 50


def test_flow_grpo_keeps_the_pipelines_sigmas_and_independent_initial_noise():
    for algorithm in ("flow_grpo", None):
        cfg = _run(*([f"{ARR}.model.algorithm={algorithm}"] if algorithm else []))
        assert (cfg.sampling.time_shift, cfg.sampling.same_initial_noise) == (None, False)


@pytest.mark.parametrize(("overrides", "message"), [
    ([f"{ARR}.model.algorithm=dance_grpo", "+digen.sampling.time_shift=3.0"],
     r"model.algorithm='dance_grpo' and digen.sampling.time_shift=3.0 are the same setting"),
    ([f"{ARR}.model.algorithm=dance_grpo", "+digen.sampling.same_initial_noise=false"],
     r"model.algorithm='dance_grpo' and digen.sampling.same_initial_noise=False are the same setting"),
    ([f"{ARR}.model.algorithm=mix_grpo"], r"model.algorithm='mix_grpo' cannot apply: .*dance_grpo"),
    ([f"{ARR}.actor.diffusion_loss.loss_mode=nft"], r"loss_mode='nft' cannot apply"),
    (["algorithm.adv_estimator=nft"], r"adv_estimator='nft'; .*flow_grpo / dance_grpo"),
    (["+digen.sampling.time_shift=0"], r"digen.sampling.time_shift=0.0; must be > 0"),
])
def test_what_cannot_apply_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _run(*overrides)


def test_time_shift_sigmas_are_danceGRPOs_shifted_grid():
    for steps, shift in ((10, 5.0), (4, 3.0), (1, 5.0)):
        t = np.linspace(1.0, 0.0, steps + 1)
        expected = shift * t / (1 + (shift - 1) * t)  # the SD3 time shift of a uniform grid, then sigma 0
        got = time_shift_sigmas(steps, shift)
        assert got.dtype == torch.float32 and got.shape == (steps + 1,)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=0)
        assert got[0] == 1.0 and got[-1] == 0.0 and bool((got[1:] < got[:-1]).all())
    with pytest.raises(ValueError, match="shift=0"):
        time_shift_sigmas(4, 0)


def _begin(adapter, cfg: DigenConfig, samples=None):
    from runs import PROMPTS
    from verl_digen.workers.sampling import GroupRequest, begin_groups
    from verl_digen.workers.worker import sampling_settings

    settings = sampling_settings(cfg)
    request = GroupRequest(PROMPTS, [3, 4], [0, 1], group_size=4, training_step=1, seed=7, policy_version=0,
                           samples=samples)
    return begin_groups(adapter, request, settings)


def test_a_group_shares_its_initial_noise_and_the_sigmas_are_the_shifted_ones(tiny_flux):
    from verl_digen.models import load_adapter

    torch.set_num_threads(1)
    adapter = load_adapter(tiny_flux)
    plain = _begin(adapter, DigenConfig())
    cfg = DigenConfig()
    cfg.sampling.same_initial_noise, cfg.sampling.time_shift = True, 5.0
    dance = _begin(adapter, cfg)
    x0, shared = plain.latents[0][0], dance.latents[0][0]  # [8 rows: group 3's 4 samples, group 4's]
    for g in range(2):
        rows = shared[4 * g: 4 * g + 4]
        assert all(torch.equal(row, x0[4 * g]) for row in rows)  # every sample starts from sample 0's noise
        assert not torch.equal(x0[4 * g], x0[4 * g + 1])  # which, unshared, differ
    assert not torch.equal(shared[0], shared[4])  # the groups differ
    # a slice of the group without its sample 0 (a group split over workers) shares it too
    part = _begin(adapter, cfg, samples=(2, 4))
    assert all(torch.equal(row, x0[0]) for row in part.latents[0][0][:2])
    assert torch.equal(dance.sigmas, time_shift_sigmas(cfg.sampling.num_steps, 5.0))
    assert not torch.equal(plain.sigmas, dance.sigmas)


def test_the_sde_noise_stays_per_sample_with_a_shared_start(tiny_flux):
    """Sharing the start changes nothing else: each sample's SDE steps draw the noise they draw
    without sharing, so a group's trajectories still spread."""
    from verl_digen.models import load_adapter
    from verl_digen.workers.sampling import denoise

    torch.set_num_threads(1)
    adapter = load_adapter(tiny_flux)
    cfg = DigenConfig()
    cfg.sampling.same_initial_noise = True
    from verl_digen.workers.worker import sampling_settings

    settings = dataclasses.replace(sampling_settings(cfg))
    state = _begin(adapter, cfg)
    denoise(adapter, state, settings, 1)
    block = state.latents[-1]  # [k, B, ...]: x_0 and x_1 of the 8 rows
    assert torch.equal(block[0][0], block[0][1])  # the same start
    assert not torch.equal(block[-1][0], block[-1][1])  # one SDE step later, apart
