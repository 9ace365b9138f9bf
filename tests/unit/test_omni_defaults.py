"""A veRL-Omni recipe that leaves a key unwritten learns with veRL-Omni's default for it: the SDE
noise level (1.0, its DiffusionRolloutAlgoConfig's, every sde_type), the SDE window without
sde_window_size (its pipeline adapters' (0, N - 1): steps 0..N-2 stochastic and trained, the last
an ODE step), the denoising steps (10), the learning rate (1e-6) and weight decay (0.01); a veRL
job keeps verl-digen's defaults, and a written key (veRL-Omni's or digen's) wins. Wan's
pipeline.num_frames (veRL-Omni's Wan2.2 dance recipe writes 8) is rounded as diffusers'
WanPipeline rounds it, with one notice line."""

from __future__ import annotations

import json
import shlex

import pytest
from omegaconf import OmegaConf

from test_dance_grpo import WAN22_DANCE
from test_omni_keys import _verl_config
from verl_digen.algos.window import select_sde_window
from verl_digen.config.omni_keys import plain_overrides
from verl_digen.config.schema import ConfigError, DigenConfig, SamplingConfig, AlgoConfig, digen_config_from_dict
from verl_digen.config.verl_keys import MAIN_PPO, RunConfig, override_keys, resolve_run_config

ARR = "actor_rollout_ref"
ALGO = f"{ARR}.rollout.algo"
PIPE = f"{ARR}.rollout.pipeline"
FLOW = "algorithm.adv_estimator=flow_grpo"  # the smallest veRL-Omni recipe: its estimator alone


def _resolve(*overrides: str) -> RunConfig:
    """What main_ppo's digen mode resolves for these overrides (written as veRL-Omni writes them)."""
    argv = plain_overrides(["trainer.v1.trainer_mode=digen", *overrides])
    config = OmegaConf.to_container(_verl_config(argv), resolve=True)
    return resolve_run_config(config, MAIN_PPO, override_keys(argv))


def _run(*overrides: str) -> DigenConfig:
    return digen_config_from_dict(_resolve(*overrides).digen)


def _window(cfg: DigenConfig) -> tuple:
    w = cfg.sampling.sde_window
    return w.mode, w.size, w.start


@pytest.mark.parametrize("recipe", [
    [FLOW], [f"{ALGO}.sde_type=cps"], [f"{ALGO}.sde_type=dance_sde"], [f"{ARR}.model.algorithm=dance_grpo"],
    ["algorithm.adv_estimator=dance_grpo", f"{PIPE}.height=32"],
])
def test_an_unwritten_noise_level_is_veRL_Omnis_1_for_every_sde_type_and_algorithm(recipe):
    assert _run(*recipe).sampling.noise_level == 1.0


def test_a_written_noise_level_and_a_veRL_jobs_default_are_kept():
    assert _run(FLOW, f"{ALGO}.noise_level=0.8").sampling.noise_level == 0.8
    assert _run(FLOW, "+digen.sampling.noise_level=0.5").sampling.noise_level == 0.5  # digen's key wins
    assert _run().sampling.noise_level == SamplingConfig().noise_level == 0.7  # a veRL job: Flow-GRPO's
    assert _run("algorithm.adv_estimator=grpo").sampling.noise_level == 0.7
    # the attention backends tune kernels: they do not make a recipe veRL-Omni's
    assert _run(f"++{ARR}.model.attn_backend=native").sampling.noise_level == 0.7


@pytest.mark.parametrize(("recipe", "steps"), [
    ([FLOW], 10), ([f"{PIPE}.num_inference_steps=6"], 6), ([f"{ALGO}.sde_type=dance_sde", FLOW], 10),
    ([f"{ARR}.model.algorithm=dance_grpo", f"{PIPE}.num_inference_steps=4"], 4),
])
def test_without_sde_window_size_steps_0_to_N_minus_2_are_stochastic_and_the_last_is_an_ODE_step(recipe, steps):
    cfg = _run(*recipe)
    assert cfg.sampling.num_steps == steps
    assert _window(cfg) == ("fixed", steps - 1, 0)
    for training_step in (0, 3):
        assert select_sde_window(steps, cfg.sampling.sde_window, training_step=training_step,
                                 seed=1) == list(range(steps - 1))


def test_a_written_window_and_a_veRL_jobs_all_steps_are_kept():
    cfg = _run(FLOW, f"{ALGO}.sde_window_size=2", f"{ALGO}.sde_window_range=[0,5]")
    assert (*_window(cfg), cfg.sampling.sde_window.range_end) == ("random", 2, 0, 4)
    assert _window(_run(FLOW, "+digen.sampling.sde_window.mode=all")) == ("all", 0, 0)  # digen's key wins
    assert _window(_run(FLOW, "+digen.sampling.sde_window.mode=fixed", "+digen.sampling.sde_window.size=3")) == (
        "fixed", 3, 0)
    plain = _run()
    assert _window(plain) == ("all", 0, 0) and plain.sampling.num_steps == SamplingConfig().num_steps
    with pytest.raises(ConfigError, match=r"num_inference_steps=1 cannot apply: veRL-Omni's window .* 0..N-2"):
        _run(FLOW, f"{PIPE}.num_inference_steps=1")


def test_unwritten_steps_learning_rate_and_weight_decay_are_veRL_Omnis():
    cfg = _run(FLOW)
    assert (cfg.sampling.num_steps, cfg.algo.lr, cfg.algo.weight_decay) == (10, 1e-6, 0.01)
    written = _run(FLOW, f"{PIPE}.num_inference_steps=12", f"{ARR}.actor.optim.lr=3e-4",
                   f"{ARR}.actor.optim.weight_decay=0.0001")
    assert (written.sampling.num_steps, written.algo.lr, written.algo.weight_decay) == (12, 3e-4, 1e-4)
    assert _run(FLOW, "+digen.algo.lr=0.5").algo.lr == 0.5
    plain = _run()  # a veRL job: verl-digen's defaults, as before
    assert (plain.algo.lr, plain.algo.weight_decay) == (AlgoConfig().lr, AlgoConfig().weight_decay)


def _wan_dir(tmp_path, temporal):
    model = tmp_path / "Wan2.2-TI2V-5B-Diffusers"
    (model / "vae").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    (model / "vae" / "config.json").write_text(json.dumps({"scale_factor_temporal": temporal}))
    return str(model)


def test_veRL_Omnis_wan22_dance_recipes_8_frames_are_rounded_as_diffusers_rounds_them(tmp_path):
    model = _wan_dir(tmp_path, 4)
    run = _resolve(*shlex.split(WAN22_DANCE), f"{ARR}.model.path={model}", f"{PIPE}.num_frames=8")
    assert digen_config_from_dict(run.digen).sampling.num_frames == 9  # 8 // 4 * 4 + 1, WanPipeline's rule
    notice = run.notice()
    assert notice is not None and len(notice.splitlines()) == 1
    assert f"{PIPE}.num_frames=8" in notice and "num_frames=9" in notice
    for given, used in ((81, 81), (10, 9), (5, 5), (1, 1)):  # t * k + 1 stays, without a notice
        run = _resolve(f"{ARR}.model.path={model}", f"{PIPE}.num_frames={given}")
        assert run.digen["sampling"]["num_frames"] == used
        assert (run.notice() is not None) == (given != used)


def test_the_tiny_wans_frames_round_with_its_temporal_factor_and_image_families_draw_one():
    run = _resolve("+digen.model.tiny_arch=wan", f"{PIPE}.num_frames=8")
    assert run.digen["sampling"]["num_frames"] == 9  # temporal factor 2: 8 // 2 * 2 + 1
    assert _resolve("+digen.model.tiny_arch=wan", f"{PIPE}.num_frames=7").notice() is None
    assert _run(f"{PIPE}.num_frames=1").sampling.num_frames == 1
    with pytest.raises(ConfigError, match=r"num_frames=5 cannot apply: flux draws images"):
        _resolve(f"{PIPE}.num_frames=5")
    with pytest.raises(ConfigError, match=r"num_frames=8 and digen.sampling.num_frames=5 are the same setting"):
        _resolve("+digen.model.tiny_arch=wan", f"{PIPE}.num_frames=8", "+digen.sampling.num_frames=5")


def test_a_presets_and_a_config_groups_values_are_chosen_not_replaced_by_veRL_Omnis_defaults():
    """flux_colocated writes noise_level 0.7 and a window; +smoke=tiny every step at 4 steps: a
    veRL-Omni key on top of them keeps what the preset chose (verl_digen.main's presets)."""
    from verl_digen.config.compose import compose_config, written_keys

    def _resolved(*overrides, config_name="digen_trainer"):
        config = compose_config(plain_overrides(list(overrides)), config_name=config_name)
        return resolve_run_config(OmegaConf.to_container(config, resolve=True), written=written_keys(config))

    preset = digen_config_from_dict(_resolved(f"{PIPE}.height=512", config_name="flux_colocated").digen)
    assert preset.sampling.noise_level == 0.7 and preset.sampling.num_steps == 16
    assert preset.algo.lr == 3e-4 and preset.sampling.sde_window.mode != "fixed"
    smoke = digen_config_from_dict(_resolved("+smoke=tiny", FLOW).digen)
    assert (smoke.sampling.num_steps, _window(smoke)) == (4, ("all", 0, 0))
    assert smoke.sampling.noise_level == 1.0  # the smoke group writes none: veRL-Omni's
    base = digen_config_from_dict(_resolved(FLOW).digen)  # verl_digen.main without a preset
    assert (base.sampling.noise_level, base.sampling.num_steps, _window(base)) == (1.0, 10, ("fixed", 9, 0))
