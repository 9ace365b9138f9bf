"""veRL-Omni's diffusion keys in the digen mode: Hydra accepts them as veRL-Omni's scripts write
them (no '+'), each maps onto its digen.* setting with the one-value-per-setting rule, and values
verl-digen cannot honour are refused naming the key and what to use instead. The real
``python -m verl.trainer.main_ppo`` taking them: tests/e2e/test_omni_keys_e2e.py."""

from __future__ import annotations

import json
import os
import shlex

import pytest
from omegaconf import OmegaConf

from verl_digen.config.compose import compose_config
from verl_digen.config.omni_keys import plain_overrides
from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.config.verl_keys import MAIN_PPO, resolve_run_config

ARR = "actor_rollout_ref"


def _resolved(*overrides: str):
    """verl_digen.main's config, the overrides written as veRL-Omni writes them (no '+')."""
    config = compose_config(plain_overrides(list(overrides)))
    return resolve_run_config(OmegaConf.to_container(config, resolve=True))


def _verl_config(overrides: list[str]):
    """What main_ppo composes: veRL's own ppo_trainer config, no digen group (compose_config
    composes it as Hydra does, test_config.py::test_composing_from_the_cached_defaults_is_hydras_composition)."""
    import verl

    return compose_config(overrides, config_name="ppo_trainer",
                          config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"))


def _sd3_dir(tmp_path):
    model = tmp_path / "stable-diffusion-3.5-medium"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    return model


# veRL-Omni's examples/flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora.sh, line for line as the
# shell hands them to Python (its engine settings too: rollout.name, agent.num_workers,
# load_format, engine_kwargs.vllm_omni.*, reward.num_workers, attention backends), less the
# vLLM-served reward model's keys (SD35_REWARD_MODEL below); environment keys (paths, devices,
# logger, steps) changed.
SD35_OCR_LORA = """
    trainer.v1.trainer_mode=digen data.train_files={train} data.val_files={val} data.train_batch_size=8 data.val_max_samples=32
    data.max_prompt_length=512 data.truncation=error data.seed=42
    actor_rollout_ref.model.algorithm=flow_grpo actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.model.custom_chat_template="\\"{{% for message in messages %}}{{% if message['role'] == 'user' %}}{{{{ message['content'] }}}}{{% endif %}}{{% endfor %}}\\""
    'actor_rollout_ref.model.extra_tokenizers={{clip: {{path: tokenizer, max_length: 77}}, t5: {{path: tokenizer_3, max_length: 256}}}}'
    actor_rollout_ref.model.attn_backend=native actor_rollout_ref.rollout.rollout_attn_backend=TORCH_SDPA
    actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=64
    actor_rollout_ref.model.target_modules="['to_q','to_k','to_v','to_out.0','add_q_proj','add_k_proj','add_v_proj','to_add_out']"
    actor_rollout_ref.actor.optim.lr=1e-4 actor_rollout_ref.actor.optim.weight_decay=0.0001
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16 actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.name=vllm_omni actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.seed=42
    actor_rollout_ref.rollout.agent.num_workers=2 actor_rollout_ref.rollout.load_format=safetensors
    ++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=256
    ++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.request_batch_max_wait_ms=10
    reward.num_workers=1
    actor_rollout_ref.rollout.pipeline.height=384 actor_rollout_ref.rollout.pipeline.width=384
    actor_rollout_ref.rollout.pipeline.num_inference_steps=10 actor_rollout_ref.rollout.pipeline.guidance_scale=1.0
    actor_rollout_ref.rollout.pipeline.max_sequence_length=256 actor_rollout_ref.rollout.max_prompt_embed_length=333
    actor_rollout_ref.rollout.algo.noise_level=0.8 actor_rollout_ref.rollout.algo.sde_type="cps"
    actor_rollout_ref.rollout.algo.sde_window_size=3 actor_rollout_ref.rollout.algo.sde_window_range="[0,5]"
    actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=28
    actor_rollout_ref.rollout.val_kwargs.algo.noise_level=0.0
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    reward.custom_reward_function.path={reward} reward.custom_reward_function.name=compute_score_ocr
    trainer.logger='["console"]' trainer.project_name=flow_grpo trainer.experiment_name=sd35_medium_ocr_lora
    trainer.log_val_generations=8 trainer.val_before_train=False trainer.n_gpus_per_node=2 trainer.nnodes=1
    trainer.save_freq=100 trainer.test_freq=20 trainer.total_epochs=15 trainer.total_training_steps=100
"""


# The SD3.5 recipe's reward model: GenRM-OCR served by vLLM inside veRL's reward loop, a service a
# digen run does not start (it scores with reward functions and reward servers): a ported recipe
# drops these keys and names its reward function instead.
SD35_REWARD_MODEL = """
    reward.reward_model.enable=True reward.reward_model.model_path=Qwen/Qwen2.5-VL-3B-Instruct
    reward.reward_model.rollout.name=vllm reward.reward_model.enable_resource_pool=True
    reward.reward_model.nnodes=1 reward.reward_model.n_gpus_per_node=1
    reward.reward_model.rollout.gpu_memory_utilization=0.9 reward.reward_model.rollout.free_cache_engine=False
    reward.reward_model.rollout.tensor_model_parallel_size=1 reward.reward_model.rollout.enforce_eager=False
"""

# veRL-Omni's examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_reward_server.sh, key for key
# as the shell hands them to Python, every key as shipped (its engine settings too: they tune
# vLLM-Omni and are noticed); test_omni_recipes.py trains it under main_ppo.
QWEN_OCR_REWARD_SERVER = """
    algorithm.adv_estimator=flow_grpo data.train_files={train} data.val_files={val} data.train_batch_size=32
    data.max_prompt_length=256 actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=3e-5 actor_rollout_ref.actor.optim.weight_decay=0.0001
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_grpo actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.n=16 actor_rollout_ref.rollout.layered_summon=True
    actor_rollout_ref.rollout.name=vllm_omni actor_rollout_ref.rollout.agent.num_workers=4
    actor_rollout_ref.rollout.load_format=safetensors
    actor_rollout_ref.rollout.pipeline.true_cfg_scale=1.0
    actor_rollout_ref.rollout.pipeline.height=512 actor_rollout_ref.rollout.pipeline.width=512
    actor_rollout_ref.rollout.pipeline.max_sequence_length=256
    actor_rollout_ref.rollout.algo.noise_level=1.2 actor_rollout_ref.rollout.algo.sde_type="sde"
    actor_rollout_ref.rollout.algo.sde_window_size=2 actor_rollout_ref.rollout.algo.sde_window_range="[0,5]"
    actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=50
    actor_rollout_ref.rollout.val_kwargs.algo.noise_level=0.0
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
    reward.reward_model.enable=False
    reward.custom_reward_function.path=pkg://verl_omni.reward_loop.reward_manager.multi
    reward.custom_reward_function.name=_multi_reward_placeholder
    reward.reward_manager.name=MultiVisualRewardManager
    reward.reward_manager.module.path=pkg://verl_omni.reward_loop.reward_manager
    "+reward.reward_functions.ocr.path=pkg://verl_omni.utils.reward_score.http_scorer_client"
    '+reward.reward_functions.ocr.name=compute_score' '+reward.reward_functions.ocr.weight=1.0'
    "+reward.reward_functions.ocr.server_url={server_url}"
    trainer.logger='["console", "wandb"]' trainer.project_name=flow_grpo
    trainer.experiment_name=qwen_image_ocr_reward_server trainer.default_local_dir={checkpoints}
    +trainer.rollout_data_dir={rollout_data_dir} trainer.log_val_generations=8 trainer.val_before_train=False
    trainer.n_gpus_per_node=4 trainer.nnodes=1 trainer.save_freq=30 trainer.test_freq=10 trainer.total_epochs=15
    trainer.total_training_steps=300
"""


def _recipe_argv(recipe: str, tmp_path) -> list[str]:
    """The recipe's command line as main_ppo gets it in the digen mode (trainer_mode written once)."""
    return ["trainer.v1.trainer_mode=digen"] * ("trainer_mode" not in recipe) + shlex.split(recipe.format(train=tmp_path / "train.parquet", val=tmp_path / "test.parquet",
                                     model=_sd3_dir(tmp_path), reward=tmp_path / "genrm_ocr.py",
                                     server_url="http://127.0.0.1:1/score", checkpoints=tmp_path / "ck",
                                     rollout_data_dir=tmp_path / "rollouts"))


@pytest.mark.parametrize("recipe", ["sd35_ocr_lora", "qwen_image_ocr_reward_server"])
def test_every_key_of_a_carried_recipe_lands_in_one_class_and_the_run_does_what_its_class_says(recipe, tmp_path):
    """Each key a veRL-Omni recipe writes is honoured (it sets or checks a digen setting), at veRL's
    default, an engine setting (accepted, named in one notice line) or refused (it would change
    what is learned and cannot apply: here only the vLLM-served reward model's keys). The classes
    are those resolve_run_config acts on: the engine settings are exactly its notice's, the refused
    keys exactly its error's, all named in one message."""
    from verl_digen.config.omni_keys import tree_get
    from verl_digen.config.verl_keys import ENGINE, HONOURED, REFUSED, key_class, override_keys

    text = SD35_OCR_LORA + SD35_REWARD_MODEL if recipe == "sd35_ocr_lora" else QWEN_OCR_REWARD_SERVER
    argv = plain_overrides(_recipe_argv(text, tmp_path))
    config = OmegaConf.to_container(_verl_config(argv), resolve=True)
    written = override_keys(argv)
    classes = {key: key_class(key, tree_get(config, key), MAIN_PPO) for key in sorted(written)}
    engine = {k for k, c in classes.items() if c == ENGINE}
    refused = {k for k, c in classes.items() if c == REFUSED}
    expected_engine = {f"{ARR}.rollout.name", f"{ARR}.rollout.agent.num_workers", f"{ARR}.rollout.load_format",
                       f"{ARR}.rollout.tensor_model_parallel_size"}  # 1 here, veRL's default 2
    if recipe == "sd35_ocr_lora":
        expected_engine |= {f"{ARR}.rollout.engine_kwargs.vllm_omni.max_num_seqs", "reward.num_workers",
                            f"{ARR}.rollout.engine_kwargs.vllm_omni.request_batch_max_wait_ms",
                            f"{ARR}.model.attn_backend", f"{ARR}.rollout.rollout_attn_backend"}
        # the reward model's keys, less those at veRL's default value
        assert "reward.reward_model.enable" in refused <= override_keys(shlex.split(SD35_REWARD_MODEL))
    else:
        assert refused == set()
    assert engine == expected_engine
    assert classes[f"{ARR}.rollout.pipeline.height"] == HONOURED and classes["data.train_batch_size"] == HONOURED
    if refused:
        with pytest.raises(ConfigError) as stopped:
            resolve_run_config(config, MAIN_PPO, written)
        assert all(key in str(stopped.value) for key in refused)
        argv = [a for a in argv if a.lstrip("+").partition("=")[0] not in refused]
        config = OmegaConf.to_container(_verl_config(argv), resolve=True)
        written = override_keys(argv)
    run = resolve_run_config(config, MAIN_PPO, written)
    assert set(run.engine_keys) == expected_engine
    assert all(key in run.notice() for key in expected_engine)


def test_verl_omnis_sd35_ocr_lora_command_line_composes_into_the_digen_config(tmp_path):
    argv = shlex.split(SD35_OCR_LORA.format(train=tmp_path / "train.parquet", val=tmp_path / "test.parquet",
                                            model=_sd3_dir(tmp_path), reward=tmp_path / "genrm_ocr.py"))
    with pytest.raises(Exception, match="Could not override"):  # what veRL's Hydra says without the plugin
        _verl_config(argv)
    config = OmegaConf.to_container(_verl_config(plain_overrides(argv)), resolve=True)
    digen = resolve_run_config(config, MAIN_PPO).digen
    cfg = digen_config_from_dict(digen)  # the whole digen config is valid
    s = cfg.sampling
    assert (s.height, s.width, s.num_steps, s.guidance_scale) == (384, 384, 10, 1.0)
    assert (s.noise_level, s.sde_type) == (0.8, "cps")
    w = s.sde_window  # start uniform in [0, 5 - 3]: steps [start, start + 3) inside [0, 5)
    assert (w.mode, w.size, w.start, w.range_end) == ("random", 3, 0, 4)
    assert (cfg.algo.clip_range, cfg.algo.kl_beta, cfg.algo.lr) == (1e-5, 0.0, 1e-4)
    assert cfg.fsdp.enable and cfg.model.dtype == "bf16"
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (32, 64)
    assert (cfg.validation.num_steps, cfg.validation.log_images, cfg.validation.num_prompts) == (28, 8, 32)
    assert (cfg.batch.group_size, cfg.batch.groups_per_step, cfg.batch.train_micro_batch_groups) == (8, 8, 1)
    assert cfg.batch.mini_batches_per_step == 2  # ppo_mini_batch_size=4 of train_batch_size=8
    assert cfg.data.chat_template == ("{% for message in messages %}{% if message['role'] == 'user' %}"
                                      "{{ message['content'] }}{% endif %}{% endfor %}")
    assert cfg.reward.name == "custom" and cfg.reward.kwargs["function"] == "compute_score_ocr"


def test_plain_overrides_rewrites_only_veRL_Omnis_diffusion_keys():
    argv = [f"{ARR}.rollout.pipeline.height=384", f"+{ARR}.rollout.algo.noise_level=0.8",
            f"++{ARR}.model.algorithm=flow_grpo", f"~{ARR}.rollout.pipeline", "data.train_batch_size=8",
            "+trainer.rollout_data_dir=/tmp/r", f"{ARR}.actor.diffusion_loss.clip_ratio=1e-5", "--config-name=x"]
    assert plain_overrides(argv) == [
        f"++{ARR}.rollout.pipeline.height=384", f"++{ARR}.rollout.algo.noise_level=0.8",
        f"++{ARR}.model.algorithm=flow_grpo", f"~{ARR}.rollout.pipeline", "data.train_batch_size=8",
        "++trainer.rollout_data_dir=/tmp/r", f"++{ARR}.actor.diffusion_loss.clip_ratio=1e-5", "--config-name=x"]


@pytest.mark.parametrize("arg", ["+trainer.rollout_data_dir=/tmp/r", "trainer.rollout_data_dir=/tmp/r",
                                 "++trainer.rollout_data_dir=/tmp/r"])
def test_rollout_data_dir_as_veRL_users_write_it_sets_the_dump_under_main_ppo(arg):
    config = OmegaConf.to_container(_verl_config(plain_overrides(["trainer.v1.trainer_mode=digen", arg])),
                                    resolve=True)
    assert digen_config_from_dict(resolve_run_config(config, MAIN_PPO).digen).rollout_data_dir == "/tmp/r"
    assert digen_config_from_dict(_resolved(arg).digen).rollout_data_dir == "/tmp/r"  # verl_digen.main alike


def test_the_plugin_rewrites_main_ppos_command_line_in_the_digen_mode_only():
    from verl_digen.verl_hooks import MAIN_PPO_MODULE, accept_omni_keys

    key = f"{ARR}.rollout.pipeline.height=384"
    argv = ["main_ppo.py", "trainer.v1.trainer_mode=digen", key]
    assert accept_omni_keys(argv, MAIN_PPO_MODULE) and argv[2] == f"++{key}"
    for main, mode in ((MAIN_PPO_MODULE, "sync"), ("some.other.program", "digen")):
        argv = ["x.py", f"trainer.v1.trainer_mode={mode}", key]
        assert not accept_omni_keys(argv, main) and argv[2] == key
    argv = ["main_ppo.py", key]  # veRL's default mode
    assert not accept_omni_keys(argv, MAIN_PPO_MODULE) and argv[1] == key


def test_one_value_per_setting_across_veRL_Omni_veRL_and_digen_keys():
    clip = f"{ARR}.actor.diffusion_loss.clip_ratio"
    with pytest.raises(ConfigError, match=rf"{clip}=1e-05 and digen.algo.clip_range=0.001 are the same setting"):
        _resolved(f"{clip}=1e-5", "digen.algo.clip_range=1e-3")
    with pytest.raises(ConfigError, match=rf"{ARR}.actor.clip_ratio and {clip} set digen.algo.clip_range"):
        _resolved(f"{ARR}.actor.clip_ratio=0.001", f"{clip}=1e-5")
    assert _resolved(f"{clip}=1e-5", "digen.algo.clip_range=1e-5").digen["algo"]["clip_range"] == 1e-5
    with pytest.raises(ConfigError, match=rf"{ARR}.rollout.pipeline.num_inference_steps=10 and "
                                          r"digen.sampling.num_steps=12"):
        _resolved(f"{ARR}.rollout.pipeline.num_inference_steps=10", "digen.sampling.num_steps=12")


def test_guidance_scale_means_what_diffusers_means_for_the_family():
    guidance = f"{ARR}.rollout.pipeline.guidance_scale=3.5"
    assert _resolved(guidance).digen["sampling"]["distilled_guidance"] == 3.5  # the tiny FLUX
    assert _resolved(guidance, "digen.model.arch=sd3").digen["sampling"]["guidance_scale"] == 3.5
    assert _resolved(f"{ARR}.rollout.pipeline.true_cfg_scale=4.0").digen["sampling"]["guidance_scale"] == 4.0
    with pytest.raises(ConfigError, match=r"guidance_scale=3.5 cannot apply: Qwen-Image is not guidance-distilled"):
        _resolved(guidance, "digen.model.arch=qwen_image")


@pytest.mark.parametrize(("overrides", "message"), [
    ([f"{ARR}.model.algorithm=dpo"], r"model.algorithm='dpo' cannot apply: verl-digen trains FlowGRPO"),
    ([f"{ARR}.actor.diffusion_loss.dpo_beta=2000"], r"diffusion_loss.dpo_beta=2000 cannot apply: .*other algorithms"),
    ([f"{ARR}.actor.diffusion_loss.ref_kl_coef=0.1"], r"ref_kl_coef=0.1 cannot apply: .*use_kl_loss=true"),
    ([f"{ARR}.rollout.algo.sde_window_range=[0,5]"], r"sde_window_range=\[0, 5\] cannot apply: it needs .*size"),
    ([f"{ARR}.rollout.algo.sde_window_size=3"], r"sde_window_size=3 cannot apply: give .*sde_window_range"),
    ([f"{ARR}.rollout.algo.sde_window_size=6", f"{ARR}.rollout.algo.sde_window_range=[0,5]"],
     r"sde_window_size=6 cannot apply: must be an integer in \[1, 5\]"),
    ([f"{ARR}.rollout.algo.sde_type=ode"], r"sde_type='ode'; valid: sde, cps, dance_sde"),
    ([f"{ARR}.rollout.val_kwargs.algo.noise_level=0.5"], r"val_kwargs.algo.noise_level=0.5 cannot apply: .*deterministic"),
    ([f"{ARR}.rollout.pipeline.height=384", f"{ARR}.rollout.val_kwargs.pipeline.height=512"],
     r"val_kwargs.pipeline.height=512 cannot apply: .*equal actor_rollout_ref.rollout.pipeline.height=384"),
    ([f"{ARR}.rollout.max_prompt_embed_length=333"], r"max_prompt_embed_length=333 cannot apply: .*flux"),
    ([f"{ARR}.model.extra_tokenizers={{t5: {{path: tokenizer_2, max_length: 256}}}}"],
     r"extra_tokenizers.t5.max_length=256 cannot apply: .*tokenizer_2 with 512 tokens"),
    ([f"{ARR}.rollout.pipeline.num_frames=81"], r"pipeline.num_frames=81 cannot apply: flux draws images: 1 frame"),
    ([f"{ARR}.actor.strategy=megatron"], r"strategy='megatron'; valid: fsdp2"),
    (["+trainer.rollout_data_dir=true"], r"trainer.rollout_data_dir=True; a directory to dump"),
    (["trainer.log_val_generations=-1"], r"log_val_generations=-1; a positive number"),
])
def test_values_verl_digen_cannot_honour_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _resolved(*overrides)


def test_sd3_text_lengths_and_tokenizers_are_checked_against_the_family():
    ok = _resolved("digen.model.arch=sd3", f"{ARR}.rollout.pipeline.max_sequence_length=256",
                   f"{ARR}.rollout.max_prompt_embed_length=333",
                   f"{ARR}.model.extra_tokenizers={{clip: {{path: tokenizer, max_length: 77}}, "
                   f"t5: {{path: tokenizer_3, max_length: 256}}}}")
    assert ok.digen["model"]["arch"] == "sd3"
    with pytest.raises(ConfigError, match=r"extra_tokenizers.t5.path='text_encoder' cannot apply: .*tokenizer_3"):
        _resolved("digen.model.arch=sd3", f"{ARR}.model.extra_tokenizers={{t5: {{path: text_encoder, max_length: 256}}}}")


def test_max_sequence_length_maps_and_the_embed_length_follows_it():
    """veRL-Omni's Qwen-Image recipe encodes prompts to 256 tokens: digen.model.max_sequence_length,
    and max_prompt_embed_length is checked at that length (SD3: 77 CLIP tokens + the T5 ones)."""
    qwen = _resolved("digen.model.arch=qwen_image", f"{ARR}.rollout.pipeline.max_sequence_length=256",
                     f"{ARR}.rollout.max_prompt_embed_length=256")
    assert digen_config_from_dict(qwen.digen).model.max_sequence_length == 256
    sd3 = _resolved("digen.model.arch=sd3", f"{ARR}.rollout.pipeline.max_sequence_length=128",
                    f"{ARR}.rollout.max_prompt_embed_length=205",
                    f"{ARR}.model.extra_tokenizers={{t5: {{path: tokenizer_3, max_length: 128}}}}")
    assert sd3.digen["model"]["max_sequence_length"] == 128
    with pytest.raises(ConfigError, match=r"max_prompt_embed_length=333 cannot apply: the sd3 transformer sees 205 "
                                          r"text tokens per prompt here \(at max_sequence_length=128\)"):
        _resolved("digen.model.arch=sd3", f"{ARR}.rollout.pipeline.max_sequence_length=128",
                  f"{ARR}.rollout.max_prompt_embed_length=333")
    with pytest.raises(ConfigError, match=r"max_prompt_embed_length=512 cannot apply: .*256 text tokens"):
        _resolved("digen.model.arch=qwen_image", "digen.model.max_sequence_length=256",
                  f"{ARR}.rollout.max_prompt_embed_length=512")
    with pytest.raises(ConfigError, match=r"max_sequence_length"):  # one value per setting
        _resolved(f"{ARR}.rollout.pipeline.max_sequence_length=256", "digen.model.max_sequence_length=128")
    with pytest.raises(ConfigError, match=r"max_sequence_length=1025; .*<= 1024 \(the qwen_image pipeline's limit\)"):
        digen_config_from_dict(_resolved("digen.model.arch=qwen_image", "digen.model.max_sequence_length=1025").digen)
    with pytest.raises(ConfigError, match=r"digen.model.max_sequence_length=1024; an integer >= 1 and <= 512 \(the "
                                          r"flux pipeline's limit\)"):  # the tiny FLUX
        digen_config_from_dict(_resolved(f"{ARR}.rollout.pipeline.max_sequence_length=1024").digen)


def test_optimizer_offload_maps_and_auto_parks_only_colocated():
    """veRL's fsdp_config.optimizer_offload=True: the optimizer state waits on the host between
    steps (digen.model.optimizer_offload=true); veRL's default False reads as unset (auto: fused
    workers park it while they generate, disaggregated trainers keep it)."""
    on = digen_config_from_dict(_resolved(f"{ARR}.actor.fsdp_config.optimizer_offload=True",
                                          "digen.placement=disaggregated").digen)
    assert on.model.optimizer_offload == "true" and on.optimizer_offloaded
    default = digen_config_from_dict(_resolved(f"{ARR}.actor.fsdp_config.optimizer_offload=False").digen)
    assert default.model.optimizer_offload == "auto" and default.placement == "colocated" and default.optimizer_offloaded
    trainers = digen_config_from_dict(_resolved("digen.placement=disaggregated").digen)
    assert not trainers.optimizer_offloaded
    with pytest.raises(ConfigError, match=r"digen.model.optimizer_offload='sometimes'; valid: true, false, auto"):
        digen_config_from_dict(_resolved("digen.model.optimizer_offload=sometimes").digen)
    # param_offload is FSDP's host offload: veRL's key turns FSDP2 on with it; digen's alone is refused.
    both = digen_config_from_dict(_resolved(f"{ARR}.actor.fsdp_config.param_offload=True").digen)
    assert both.fsdp.param_offload and both.fsdp.enable
    with pytest.raises(ConfigError, match=r"digen.fsdp.param_offload=True; it is FSDP2's host offload: set "
                                          r"digen.fsdp.enable=true too"):
        digen_config_from_dict(_resolved("digen.fsdp.param_offload=true").digen)


def test_strategy_and_log_val_generations_map_and_veRLs_defaults_set_nothing():
    run = _resolved(f"{ARR}.actor.strategy=fsdp2", "trainer.log_val_generations=4",
                    f"{ARR}.rollout.val_kwargs.pipeline.num_inference_steps=28")
    assert run.digen["fsdp"]["enable"] is True and run.digen["validation"]["log_images"] == 4
    assert run.digen["validation"]["num_steps"] == 28
    plain = digen_config_from_dict(_resolved(f"{ARR}.actor.strategy=fsdp", "trainer.log_val_generations=0").digen)
    assert plain.fsdp.enable is False and plain.validation.log_images is None


QWEN_MULTI = [
    "reward.custom_reward_function.path=pkg://verl_omni.reward_loop.reward_manager.multi",
    "reward.custom_reward_function.name=_multi_reward_placeholder",
    "reward.reward_manager.name=MultiVisualRewardManager",
    "reward.reward_manager.module.path=pkg://verl_omni.reward_loop.reward_manager",
    "+reward.reward_functions.ocr.path=pkg://json", "+reward.reward_functions.ocr.name=dumps",
    "+reward.reward_functions.ocr.weight=1.0", "+reward.reward_functions.ocr.server_url=http://localhost:19082",
    "+reward.reward_functions.jpeg.path=pkg://json", "+reward.reward_functions.jpeg.name=loads",
    "+reward.reward_functions.jpeg.weight=0.25", "+reward.reward_functions.jpeg.required=true",
]


def test_veRL_Omnis_multi_reward_manager_is_a_weighted_sum_of_its_functions():
    """The Qwen-Image reward-server recipe's reward keys: veRL-Omni's placeholder function, its
    manager's module, and one entry per reward function with its own settings."""
    reward = _resolved(*QWEN_MULTI).digen["reward"]
    assert reward["name"] == "weighted" and reward["kwargs"] == {}
    ocr, jpeg = reward["components"]
    assert (ocr["label"], ocr["weight"], jpeg["label"], jpeg["weight"]) == ("ocr", 1.0, "jpeg", 0.25)
    assert ocr["kwargs"] == {"path": "pkg://json", "function": "dumps", "required": False,
                             "reward_kwargs": {"server_url": "http://localhost:19082"},
                             "where": "reward.reward_functions.ocr"}
    assert jpeg["kwargs"]["required"] is True and jpeg["kwargs"]["reward_kwargs"] == {}


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: [x for x in a if not x.startswith("+reward.reward_functions")],
     r"reward.reward_functions and reward.reward_manager.name=MultiVisualRewardManager go together"),
    (lambda a: [x for x in a if not x.startswith(("reward.reward_manager", "reward.custom_reward_function"))],
     r"reward.reward_functions and reward.reward_manager.name=MultiVisualRewardManager go together"),
    (lambda a: [x for x in a if not x.startswith("reward.reward_manager.name")],
     r"reward.reward_manager.module.path=.* cannot apply"),
    (lambda a: [x.replace("_multi_reward_placeholder", "compute_score") for x in a],
     r"the rewards are reward.reward_functions; leave reward.custom_reward_function unset or at veRL-Omni's"),
    (lambda a: [x.replace("pkg://verl_omni.reward_loop.reward_manager", "pkg://my.managers") for x in a],
     r"reward.reward_manager.module.path='pkg://my.managers' cannot apply"),
    (lambda a: [x.replace("weight=1.0", "weight=-0.25") for x in a], r"weights of reward.reward_functions sum to 0"),
    (lambda a: [x.replace("required=true", "required=maybe") for x in a],
     r"reward.reward_functions.jpeg.required='maybe'; must be true or false"),
    (lambda a: [x for x in a if not x.startswith("+reward.reward_functions.jpeg.name")],
     r"reward.reward_functions.jpeg needs path and name"),
])
def test_the_multi_reward_keys_are_refused_naming_what_is_wrong(change, message):
    with pytest.raises(ConfigError, match=message):
        _resolved(*change(QWEN_MULTI))


def test_the_multi_reward_keys_and_digen_reward_may_not_both_choose():
    with pytest.raises(ConfigError, match=r"reward.reward_functions and digen.reward.\* both choose the reward"):
        _resolved(*QWEN_MULTI, "digen.reward.name=colorfulness")


def test_layered_summon_is_what_the_sync_always_does():
    _resolved(f"{ARR}.rollout.layered_summon=True")
    with pytest.raises(ConfigError, match=r"layered_summon='yes'; must be true or false"):
        _resolved(f"{ARR}.rollout.layered_summon=yes")


def test_under_main_ppo_no_lora_rank_is_full_fine_tuning_as_in_veRL(tmp_path):
    """veRL-Omni's full-weight recipes set no LoRA rank: veRL's lora_rank=0 trains every weight."""
    base = ["trainer.v1.trainer_mode=digen", f"{ARR}.model.path={_sd3_dir(tmp_path)}"]
    config = OmegaConf.to_container(_verl_config(plain_overrides(base)), resolve=True)
    assert resolve_run_config(config, MAIN_PPO).digen["model"]["lora"]["enable"] is False
    config = OmegaConf.to_container(_verl_config(plain_overrides(base + [f"{ARR}.model.lora_rank=16"])), resolve=True)
    assert resolve_run_config(config, MAIN_PPO).digen["model"]["lora"] == pytest.approx(
        {**resolve_run_config(config, MAIN_PPO).digen["model"]["lora"], "enable": True, "rank": 16})
    config = OmegaConf.to_container(_verl_config(plain_overrides(base + [f"{ARR}.model.lora_alpha=32"])), resolve=True)
    with pytest.raises(ConfigError, match=r"lora_alpha is set but actor_rollout_ref.model.lora_rank is not"):
        resolve_run_config(config, MAIN_PPO)


def test_attention_backends_tune_kernels_only_and_are_noticed():
    """veRL-Omni's FA3 switch (its recipes' FA3=1) picks other attention kernels for the same
    attention: accepted, named by the notice, the run's settings unchanged."""
    fa3 = _resolved(f"{ARR}.model.attn_backend=_flash_3_varlen_hub", f"{ARR}.rollout.rollout_attn_backend=FLASH_ATTN_3_HUB")
    assert fa3.engine_keys == {f"{ARR}.model.attn_backend": "_flash_3_varlen_hub",
                               f"{ARR}.rollout.rollout_attn_backend": "FLASH_ATTN_3_HUB"}
    assert fa3.digen == _resolved().digen
    assert "attn_backend='_flash_3_varlen_hub'" in fa3.notice()
    native = _resolved(f"{ARR}.model.attn_backend=native", f"{ARR}.rollout.rollout_attn_backend=TORCH_SDPA")
    assert native.digen == _resolved().digen
