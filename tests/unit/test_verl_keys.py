"""veRL's keys map onto ours (one source of truth per setting), keys that cannot apply are
refused by name, the digen trainer mode is registered in veRL's registry, and veRL's
``validate_config`` defers to the digen mode's checks only in that mode."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.config.verl_keys import (
    MAIN_PPO,
    MAPPED,
    READ_DIRECTLY,
    override_keys,
    resolve_run_config,
    verl_defaults,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resolved(*overrides: str, entry: str = "verl_digen.main"):
    """The run config of verl_digen.main's config with ``overrides`` written on its command line."""
    return resolve_run_config(OmegaConf.to_container(compose_config(list(overrides)), resolve=True), entry,
                              override_keys(overrides))


def test_verl_defaults_file_is_veRL_composed_ppo_trainer():
    """The mapping compares against veRL's _generated_ppo_trainer.yaml: it must be what Hydra composes."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        composed = OmegaConf.to_container(compose("ppo_trainer"), resolve=False)
    GlobalHydra.instance().clear()
    composed.pop("model_engine")  # a defaults-list choice, not a setting
    assert composed == verl_defaults()


@pytest.mark.parametrize(("override", "digen_key", "value"), [
    ("actor_rollout_ref.model.path=/models/FLUX.1-dev", "model.path", "/models/FLUX.1-dev"),
    ("actor_rollout_ref.model.lora_rank=32", "model.lora.rank", 32),
    ("actor_rollout_ref.model.custom_chat_template='{{ messages[-1].content }}'", "data.chat_template",
     "{{ messages[-1].content }}"),
    ("actor_rollout_ref.model.lora_alpha=64", "model.lora.alpha", 64),
    ("actor_rollout_ref.model.target_modules=[to_q,to_v]", "model.lora.target_modules", ["to_q", "to_v"]),
    ("actor_rollout_ref.actor.optim.lr=3e-4", "algo.lr", 3e-4),
    ("actor_rollout_ref.actor.optim.weight_decay=0.0", "algo.weight_decay", 0.0),
    ("actor_rollout_ref.actor.optim.betas=[0.8,0.99]", "algo.betas", [0.8, 0.99]),
    ("actor_rollout_ref.actor.optim.clip_grad=2.0", "algo.max_grad_norm", 2.0),
    ("actor_rollout_ref.actor.optim.optimizer=SGD", "algo.optimizer", "sgd"),
    ("actor_rollout_ref.actor.clip_ratio=0.0002", "algo.clip_range", 0.0002),
    ("actor_rollout_ref.rollout.n=8", "batch.group_size", 8),
    ("data.train_batch_size=8", "batch.groups_per_step", 8),
    ("data.train_files=[/data/train.parquet]", "data.prompts", "/data/train.parquet"),
    ("data.val_files=/data/val.parquet", "validation.prompts", "/data/val.parquet"),
    ("data.shuffle=false", "data.shuffle", False),
    ("data.seed=7", "seed", 7),
    ("algorithm.norm_adv_by_std_in_grpo=false", "algo.std_mode", "none"),
    ("ray_kwargs.ray_init.num_cpus=12", "ray_num_cpus", 12),
    ("trainer.rollout_data_dir=/data/rollouts", "rollout_data_dir", "/data/rollouts"),
    ("data.max_prompt_length=77", "data.max_prompt_tokens", 77),
    ("data.filter_overlong_prompts=true", "data.filter_overlong_prompts", True),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "model.optimizer_offload", "true"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=true", "fsdp.param_offload", True),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=true", "fsdp.enable", True),
])
def test_a_verl_key_sets_its_digen_setting(override, digen_key, value):
    digen = _resolved(override).digen
    node = digen
    for part in digen_key.split("."):
        node = node[part]
    assert node == value


def test_an_optimizer_the_schema_refuses_is_named_by_the_verl_key_the_user_set():
    from verl_digen.config.schema import digen_config_from_dict

    run = _resolved("actor_rollout_ref.actor.optim.optimizer=Adagrad")
    with pytest.raises(ConfigError) as e:
        digen_config_from_dict(run.digen)
    assert "valid: adamw, sgd" in str(e.value)
    assert "actor_rollout_ref.actor.optim.optimizer='adagrad'" in run.rename(str(e.value))


def test_kl_loss_maps_to_kl_beta_and_coef_alone_is_refused():
    assert _resolved("actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.kl_loss_coef=0.04").digen["algo"]["kl_beta"] == 0.04
    with pytest.raises(ConfigError, match=r"kl_loss_coef=0.04 has no effect without .*use_kl_loss=true"):
        _resolved("actor_rollout_ref.actor.kl_loss_coef=0.04")
    # Flow-GRPO / veRL-Omni recipes write the no-op pair: accepted, no KL
    off = _resolved("actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.kl_loss_coef=0.0")
    assert off.digen.get("algo", {}).get("kl_beta", 0.0) == 0.0


def test_verl_omnis_recipe_keys_with_one_meaning_are_accepted():
    """algorithm.adv_estimator=flow_grpo is the GRPO group advantage we train with; a micro-batch
    in samples without rollout.n uses the preset's group size (it was a TypeError), and a message
    about an unset key says 'unset' (it printed '<object object at 0x...>')."""
    assert _resolved("algorithm.adv_estimator=flow_grpo").digen is not None
    micro = _resolved("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")  # the preset's group size is 4
    assert micro.digen["batch"]["train_micro_batch_groups"] == 2
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size_per_gpu=6; must divide "
                                          r"actor_rollout_ref.rollout.n=4 .* or be a multiple of it") as err:
        _resolved("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6")
    assert "object at 0x" not in str(err.value)
    from verl_digen.config import verl_keys

    assert repr(verl_keys._UNSET) == "unset"


def test_batch_sizes_in_samples_become_whole_groups():
    batch = _resolved("actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8").digen["batch"]
    assert (batch["group_size"], batch["groups_per_step"], batch["train_micro_batch_groups"],
            batch["groups_per_task"]) == (4, 4, 2, 2)


def test_a_micro_batch_below_rollout_n_is_rows_per_training_pass():
    """veRL-Omni's Wan2.2 recipe: ppo_micro_batch_size_per_gpu=4 with rollout.n=8. The plan's
    train tasks stay whole groups (advantages are over groups) and each rank trains them in
    passes of 4 rows; the reference's micro-batch key must say the same 4 with the KL on."""
    batch = _resolved("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.actor.use_kl_loss=true",
                      "actor_rollout_ref.actor.kl_loss_coef=0.01").digen["batch"]
    assert (batch["group_size"], batch["train_micro_batch_groups"], batch["train_micro_batch_rows"]) == (8, 1, 4)
    whole = _resolved("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16")
    assert whole.digen["batch"]["train_micro_batch_groups"] == 2
    assert whole.digen["batch"]["train_micro_batch_rows"] is None  # whole groups: the largest call, as before
    cfg = digen_config_from_dict(_resolved("actor_rollout_ref.rollout.n=8", "data.train_batch_size=4",
                                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2").digen)
    assert cfg.pass_rows(1) == 2  # what every worker trains a pass with, the memory plan and the cost model


def test_ppo_mini_batch_size_gives_optimizer_steps_per_rollout_batch():
    """veRL-Omni's recipes: 4 of 8 prompts per mini-batch -> two optimizer steps per step."""
    batch = _resolved("data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=4").digen["batch"]
    assert (batch["groups_per_step"], batch["mini_batches_per_step"]) == (8, 2)
    run = _resolved("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    assert run.digen["batch"]["mini_batches_per_step"] == 1
    # one value per setting: the digen key and the veRL key may not disagree
    with pytest.raises(ConfigError, match=r"ppo_mini_batch_size=4.*digen.batch.mini_batches_per_step=4 are the same"):
        _resolved("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                  "digen.batch.mini_batches_per_step=4")


def test_without_a_reference_model_its_micro_batch_key_sizes_nothing():
    """veRL-Omni's Qwen-Image recipe writes ref.log_prob_micro_batch_size_per_gpu=32 beside
    ppo_micro_batch_size_per_gpu=16 without use_kl_loss: there is no reference model to size."""
    cfg = _resolved("actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8")
    assert cfg.digen["batch"]["train_micro_batch_groups"] == 1


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6"],
     r"ppo_micro_batch_size_per_gpu=6; must divide actor_rollout_ref.rollout.n=4 \(rows per training pass\) "
     r"or be a multiple of it \(whole groups\)"),
    (["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.actor.kl_loss_coef=0.01"],
     r"ref.log_prob_micro_batch_size_per_gpu=4; must equal .*ppo_micro_batch_size_per_gpu=2"),
    (["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
      "digen.batch.train_micro_batch_rows=2"],
     r"ppo_micro_batch_size_per_gpu=4 and digen.batch.train_micro_batch_rows=2 are the same setting"),
    (["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
     r"ppo_mini_batch_size=3; must be a positive divisor of data.train_batch_size=4"),
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.actor.kl_loss_coef=0.01"],
     r"ref.log_prob_micro_batch_size_per_gpu=8; must equal .*ppo_micro_batch_size_per_gpu=4"),
])
def test_batch_sizes_that_do_not_fit_whole_groups_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _resolved(*overrides)


def test_a_verl_key_and_its_digen_twin_set_differently_are_refused():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.path='/a' and digen.model.path='/b' are the same"):
        _resolved("actor_rollout_ref.model.path=/a", "digen.model.path=/b")


def test_custom_reward_keys_choose_the_custom_reward():
    reward = _resolved("reward.custom_reward_function.path=/r/my_reward.py", "reward.reward_manager.name=batch",
                       "+reward.custom_reward_function.reward_kwargs.scale=2").digen["reward"]
    assert reward["name"] == "custom"
    assert reward["kwargs"] == {"path": "/r/my_reward.py", "function": "compute_score", "batched": True,
                                "reward_kwargs": {"scale": 2}}


def test_custom_reward_takes_the_video_fps_from_digen_and_refuses_a_second_reward():
    kwargs = _resolved("reward.custom_reward_function.path=/r/my_reward.py",
                       "+digen.reward.kwargs.fps=24").digen["reward"]["kwargs"]
    assert kwargs["fps"] == 24 and kwargs["path"] == "/r/my_reward.py"
    with pytest.raises(ConfigError, match=r"reward.custom_reward_function.path and digen.reward.\* both choose"):
        _resolved("reward.custom_reward_function.path=/r/my_reward.py", "digen.reward.name=colorfulness")


@pytest.mark.parametrize(("override", "message"), [
    ("algorithm.adv_estimator=gae", r"algorithm.adv_estimator='gae' cannot apply: GAE needs a critic"),
    ("critic.enable=true", r"critic.enable=True cannot apply: FlowGRPO has no critic"),
    ("algorithm.use_kl_in_reward=true", r"algorithm.use_kl_in_reward=True cannot apply"),
    ("actor_rollout_ref.rollout.dtype=float16", r"actor_rollout_ref.rollout.dtype='float16' cannot apply"),
    ("actor_rollout_ref.actor.ppo_epochs=2", r"actor_rollout_ref.actor.ppo_epochs=2 cannot apply.*default 1"),
    ("algorithm.gamma=0.9", r"algorithm.gamma=0.9 cannot apply"),
    ("algorithm.adv_estimator=rloo", r"algorithm.adv_estimator='rloo'.*grpo"),
    ("reward.reward_manager.name=dapo", r"reward.reward_manager.name='dapo'"),
    ("+actor_rollout_ref.foo=1", r"actor_rollout_ref.foo=1 cannot apply: it is not a veRL key"),
    ("trainer.device=npu", r"trainer.device='npu'; valid: cuda, cpu"),
])
def test_a_verl_key_that_cannot_apply_is_named(override, message):
    with pytest.raises(ConfigError, match=message):
        _resolved(override)


def test_verl_infrastructure_keys_are_left_to_verl_under_main_ppo_only():
    # main_ppo starts Ray and TransferQueue itself from these; verl_digen.main would ignore them.
    _resolved("transfer_queue.backend.SimpleStorage.num_data_storage_units=1", "trainer.v1.trainer_mode=digen",
              entry=MAIN_PPO)
    with pytest.raises(ConfigError, match=r"transfer_queue.backend.SimpleStorage.num_data_storage_units=1"):
        _resolved("transfer_queue.backend.SimpleStorage.num_data_storage_units=1")


def test_errors_name_the_verl_key_the_user_wrote():
    from verl_digen.trainer.loop import DigenTrainer

    with pytest.raises(ConfigError, match=r"^invalid config: data.train_batch_size=0; must be >= 1"):
        DigenTrainer(compose_config(["data.train_batch_size=0"]))
    with pytest.raises(FileNotFoundError, match=r"^data.train_files: prompt file '/no/such.parquet' does not exist"):
        DigenTrainer(compose_config(["data.train_files=/no/such.parquet"]))


def test_the_mapping_table_in_docs_lists_every_key():
    with open(os.path.join(REPO, "docs", "verl_keys.md")) as f:
        table = f.read()
    from verl_digen.config.omni_keys import OMNI_CHECKED

    from verl_digen.config.verl_keys import ENGINE_TUNING

    keys = [row.verl_key for row in MAPPED] + list(READ_DIRECTLY) + list(OMNI_CHECKED) + list(ENGINE_TUNING)
    missing = [k for k in keys if f"`{k}`" not in table]
    assert not missing, f"docs/verl_keys.md lacks {missing}"


# ------------------------------------------------------------------------- hooks into veRL


def test_digen_mode_is_in_veRL_trainer_registry():
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_digen import verl_hooks
    from verl_digen.trainer.verl_mode import DigenPPOTrainer

    assert get_trainer_cls("digen") is DigenPPOTrainer
    assert verl_hooks.HOOK_ERRORS == {}


def _verl_config(*overrides: str):
    """What main_ppo composes: veRL's own ppo_trainer config (compose_config composes it as Hydra
    does, test_config.py::test_composing_from_the_cached_defaults_is_hydras_composition)."""
    import verl

    return compose_config(list(overrides), config_name="ppo_trainer",
                          config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"))


def test_validate_config_runs_the_digen_checks_in_the_digen_mode_only():
    """main_ppo binds verl.utils.config.validate_config at import; the plugin wrapped it by then."""
    from verl.utils.config import validate_config

    assert getattr(validate_config, "_digen_wrapped", False)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.ppo_epochs=3 cannot apply"):
        validate_config(_verl_config("trainer.v1.trainer_mode=digen", "actor_rollout_ref.actor.ppo_epochs=3"),
                        use_reference_policy=False, use_critic=True)
    # Any other mode: veRL's own checks (here: its rule that a batch fills every device).
    with pytest.raises(AssertionError, match="real_train_batch_size"):
        validate_config(_verl_config("data.train_batch_size=3", "trainer.n_gpus_per_node=2"),
                        use_reference_policy=False, use_critic=False)


def test_digen_mode_needs_no_critic_and_no_llm_keys_from_the_user(tmp_path, tiny_flux, monkeypatch):
    """veRL's defaults (adv_estimator=gae: a critic; no log-prob micro-batch sizes) pass the digen mode's checks.
    veRL's default trainer.logger includes wandb, whose missing key is refused up front
    (test_run_failures.py): W&B is switched off here as a user without a key would."""
    from verl.utils.config import validate_config

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv("RAY_OVERRIDE_RESOURCES", raising=False)

    validate_config(_verl_config("trainer.v1.trainer_mode=digen", "trainer.total_training_steps=1",
                                 f"trainer.default_local_dir={tmp_path}", "+ray_kwargs.ray_init.num_cpus=16",
                                 "trainer.n_gpus_per_node=1"),
                    use_reference_policy=False, use_critic=True)


def test_main_ppo_on_too_few_cpu_slots_stops_at_once_naming_the_key(tmp_path, tiny_flux, monkeypatch):
    """veRL's TaskRunner starts TransferQueue (a controller and 8 storage units, a CPU slot each)
    for every trainer mode; with fewer local Ray slots than that plus the digen workers, main_ppo
    would wait 10 minutes and die without a word. The digen mode's checks stop it first."""
    from verl.utils.config import validate_config

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv("RAY_OVERRIDE_RESOURCES", raising=False)
    base = ["trainer.v1.trainer_mode=digen", "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path}",
            "trainer.n_gpus_per_node=1"]
    # 1 TaskRunner + 1 controller + 8 units + 1 fused worker (trainer.n_gpus_per_node=1) = 11
    with pytest.raises(ConfigError, match=r"local Ray with 4 CPU slots \(ray_kwargs.ray_init.num_cpus\), but needs 11.*"
                                          r"set ray_kwargs.ray_init.num_cpus=11"):
        validate_config(_verl_config(*base, "+ray_kwargs.ray_init.num_cpus=4"), use_reference_policy=False, use_critic=True)
    # fewer storage units need fewer slots; Ray's own override counts as the slots
    validate_config(_verl_config(*base, "+ray_kwargs.ray_init.num_cpus=4",
                                 "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"),
                    use_reference_policy=False, use_critic=True)
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", '{"CPU": 10}')
    with pytest.raises(ConfigError, match=r"10 CPU slots \(RAY_OVERRIDE_RESOURCES\), but needs 11"):
        validate_config(_verl_config(*base), use_reference_policy=False, use_critic=True)


def test_the_verl_hooks_we_rely_on_have_not_moved():
    """veRL symbols the digen mode relies on; fail here, not deep in a run, when veRL changes them."""
    import inspect

    from verl.trainer import main_ppo
    from verl.trainer.ppo.v1 import trainer_base
    from verl.utils import config as verl_config
    from verl.utils.import_utils import load_extern_object

    assert callable(trainer_base.register_trainer) and isinstance(trainer_base.TRAINER_REGISTRY, dict)
    wrapped = inspect.unwrap(verl_config.validate_config)
    assert list(inspect.signature(wrapped).parameters) == ["config", "use_reference_policy", "use_critic"]
    source = inspect.getsource(main_ppo)
    # main_ppo validates in its driver with the module-level function, then the TaskRunner builds the
    # trainer, asks it for LLM clients, builds the manager class named in config and calls fit.
    for line in ("from verl.utils.config import validate_config", "get_trainer_cls(config.trainer.v1.trainer_mode)",
                 'get("agent", {}).get("agent_loop_manager_class")', "llm_client=self.trainer.get_llm_client()",
                 "self.trainer.fit(self.agent_loop_manager)"):
        assert line in source, line
    assert list(inspect.signature(load_extern_object).parameters) == ["module_path", "object_name"]


def test_several_data_files_are_read_in_order_and_concatenated(tmp_path):
    """veRL's data.train_files may be a list: every file's records, in the order given."""
    import json

    import pandas as pd

    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.trainer.resolve import resolve_prompt_records

    def digen(*overrides):
        return digen_config_from_dict(_resolved(*overrides).digen)

    first = tmp_path / "a.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": f"a{i}"}] for i in range(3)],
                  "reward_model": [{"ground_truth": f"A{i}"} for i in range(3)]}).to_parquet(first)
    second = tmp_path / "b.jsonl"
    second.write_text("".join(json.dumps({"prompt": f"b{i}", "ground_truth": f"B{i}"}) + "\n" for i in range(2)))
    cfg = digen(f"data.train_files=[{first},{second}]", f"data.val_files=[{second}]")
    assert list(cfg.data.prompts) == [str(first), str(second)]
    assert cfg.validation.prompts == str(second)
    records = resolve_prompt_records(cfg)
    assert [r["prompt"] for r in records] == ["a0", "a1", "a2", "b0", "b1"]
    assert [r["ground_truth"] for r in records] == ["A0", "A1", "A2", "B0", "B1"]

    missing = digen(f"data.train_files=[{first},{tmp_path}/gone.parquet]")
    with pytest.raises(FileNotFoundError, match=r"gone.parquet' does not exist"):
        resolve_prompt_records(missing)
    with pytest.raises(ConfigError, match=r"data.train_files=\[\]"):
        _resolved("data.train_files=[]")
    mixed = digen(f"digen.data.prompts=[builtin:demo,{second}]")
    with pytest.raises(ConfigError, match="builtin prompt set cannot be combined"):
        resolve_prompt_records(mixed)


def test_recipe_keys_for_dtype_validation_samples_and_tensor_parallelism():
    """veRL-Omni's SD3.5 recipe writes fsdp_config.model_dtype=bfloat16, val_max_samples and
    rollout.tensor_model_parallel_size=1: each has its meaning here or is a no-op, not a refusal;
    another tensor-parallel size tunes the engine a digen run does not use: accepted and noticed."""
    run = _resolved("actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16", "data.val_max_samples=16",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=1")
    assert run.digen["model"]["dtype"] == "bf16" and run.digen["validation"]["num_prompts"] == 16
    assert _resolved("actor_rollout_ref.actor.fsdp_config.model_dtype=float32").digen["model"]["dtype"] == "fp32"
    tp = _resolved("actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    assert tp.engine_keys == {"actor_rollout_ref.rollout.tensor_model_parallel_size": 4}
    assert tp.digen == _resolved().digen  # it changes nothing of the run
    with pytest.raises(ConfigError, match=r"model_dtype='float16'.*valid: bfloat16"):
        _resolved("actor_rollout_ref.actor.fsdp_config.model_dtype=float16")
    with pytest.raises(ConfigError, match=r"data.val_max_samples=0"):
        _resolved("data.val_max_samples=0")


def test_gae_is_refused_when_written_and_reads_as_unset_when_inherited():
    """veRL's default adv_estimator is gae; a digen job that does not write it trains GRPO's group
    advantages (as every preset does), one that writes it asks for a critic and is refused."""
    assert _resolved().digen == _resolved("algorithm.adv_estimator=grpo").digen
    for spelling in ("algorithm.adv_estimator=gae", "++algorithm.adv_estimator=gae"):
        with pytest.raises(ConfigError, match=r"adv_estimator='gae' cannot apply: GAE needs a critic"):
            _resolved(spelling)
    assert override_keys(["a.b=1", "+c.d=x", "++e=[1,2]", "~f.g", "h.i=j=k"]) == {"a.b", "c.d", "e", "h.i"}


def test_python_m_check_refuses_a_written_gae_and_names_engine_settings_in_one_notice(capsys):
    """The keys a command line wrote reach the checks from compose_config (python -m verl_digen.check
    and verl_digen.main share check_run_config); engine settings are listed in one notice line."""
    from verl_digen.check import check

    status, lines = check("digen_trainer", ["algorithm.adv_estimator=gae"])
    assert status != 0 and any("GAE needs a critic" in line for line in lines)
    status, lines = check("digen_trainer", ["actor_rollout_ref.rollout.name=vllm_omni",
                                            "actor_rollout_ref.rollout.load_format=safetensors",
                                            "actor_rollout_ref.rollout.agent.num_workers=2",
                                            "+actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=256"])
    assert status == 0, lines
    notices = [line for line in capsys.readouterr().out.splitlines() if "notice: accepted without effect" in line]
    assert len(notices) == 1
    for key in ("rollout.name='vllm_omni'", "load_format='safetensors'", "agent.num_workers=2",
                "engine_kwargs.vllm_omni.max_num_seqs=256"):
        assert key in notices[0]


def test_every_refused_key_of_a_config_is_named_in_one_message():
    with pytest.raises(ConfigError) as refused:
        _resolved("algorithm.gamma=0.9", "actor_rollout_ref.actor.ppo_epochs=2", "critic.enable=true",
                  "algorithm.use_kl_in_reward=true", "algorithm.lam=0.5", "actor_rollout_ref.rollout.dtype=float16",
                  "actor_rollout_ref.actor.entropy_coeff=0.1", "algorithm.kl_penalty=abs")
    message = str(refused.value)
    for key in ("algorithm.gamma=0.9", "ppo_epochs=2", "critic.enable=True", "use_kl_in_reward=True", "lam=0.5",
                "rollout.dtype='float16'", "entropy_coeff=0.1", "kl_penalty='abs'"):
        assert key in message, key


CLASSES_TABLE = os.path.join(REPO, "tests", "data", "verl_key_classes.tsv")
REGENERATE = (".venv/bin/python -c \"from verl_digen.config.verl_keys import verl_key_classes; "
              "[print(f'{k}\\t{c}') for k, c in verl_key_classes().items()]\" > tests/data/verl_key_classes.tsv")


def test_every_verl_key_is_classified_as_reviewed():
    """Walked from veRL's own composed defaults: every key's class in the digen mode (honoured,
    engine setting, refused, or following another key) equals the reviewed table. A veRL upgrade
    that adds a key, or a change that moves one, fails here until the table is reviewed."""
    from verl_digen.config.verl_keys import ENGINE, HONOURED, REFUSED, verl_key_classes

    with open(CLASSES_TABLE) as f:
        reviewed = dict(line.rstrip("\n").split("\t") for line in f if line.strip())
    now = verl_key_classes()
    new, gone = sorted(now.keys() - reviewed.keys()), sorted(reviewed.keys() - now.keys())
    moved = sorted(k for k in now.keys() & reviewed.keys() if now[k] != reviewed[k])
    assert not (new or gone or moved), (
        f"veRL keys not classified as reviewed: new {new[:20]}, gone {gone[:20]}, "
        f"moved {[(k, reviewed[k], now[k]) for k in moved[:20]]}; review them, then: {REGENERATE}")
    # the classes the table holds mean what resolve_run_config does with a written value
    assert _resolved("actor_rollout_ref.rollout.enforce_eager=true").engine_keys and \
        now["actor_rollout_ref.rollout.enforce_eager"] == ENGINE
    assert now["algorithm.gamma"] == REFUSED and now["actor_rollout_ref.actor.optim.lr"] == HONOURED
    assert now["critic.enable"] == REFUSED and now["algorithm.use_kl_in_reward"] == REFUSED
