"""The digen config: one source of defaults (schema.py), one place for its rules."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict

from verl_digen.config.compose import compose_config, presets_dir
from verl_digen.config.schema import ConfigError, DigenConfig, digen_config_from_dict
from verl_digen.schedule.strategies import StrategySpec, strategy_violations

PACKAGED = presets_dir()  # configs/ in a checkout, verl_digen/config/ in an installed wheel


def _composed_digen(*overrides: str, **kw) -> dict:
    return OmegaConf.to_container(compose_config(list(overrides), **kw).digen, resolve=True)


# Presets shipped with the package (python -m verl_digen.main --config-name NAME): they override
# the defaults rather than define them.
FAMILY_PRESETS = {f"{family}_{placement}.yaml" for family in ("flux", "sd3", "qwen_image", "wan", "hunyuan_video")
                  for placement in ("colocated", "disaggregated", "full_disaggregated")} - {"wan_full_disaggregated.yaml"}
PACKAGED_PRESETS = {"digits.yaml"} | FAMILY_PRESETS


def test_packaged_yaml_defines_no_digen_default():
    files = [p for p in glob.glob(os.path.join(PACKAGED, "*.yaml")) if os.path.basename(p) not in PACKAGED_PRESETS]
    assert files
    for path in files:
        with open(path) as f:
            assert "digen" not in (yaml.safe_load(f) or {}), f"{path} defines digen defaults; they live in schema.py"


def test_composed_defaults_are_the_dataclass_defaults():
    expected = dataclasses.asdict(DigenConfig())
    expected["async"] = expected.pop("async_")  # the hydra key; `async` cannot be a field name
    assert _composed_digen() == expected
    assert digen_config_from_dict(_composed_digen()) == DigenConfig()


def test_defaults_in_effect_before_the_single_source_are_kept():
    cfg = digen_config_from_dict(_composed_digen())
    assert cfg.algo.lr == 3e-2 and cfg.model.lora.alpha == 16.0 and cfg.batch.images_per_step == 16


@pytest.mark.parametrize("preset", ["flux_colocated", "qwen_image_disaggregated"])
def test_presets_hold_the_full_tree_and_override_only_known_keys(preset):
    digen = _composed_digen(config_name=preset)
    assert set(digen) == set(_composed_digen())
    with open(os.path.join(PACKAGED, f"{preset}.yaml")) as f:
        lr = yaml.safe_load(f)["digen"]["algo"]["lr"]
    assert lr != DigenConfig().algo.lr and digen_config_from_dict(digen).algo.lr == lr  # the preset wins


def test_async_key_reaches_the_async_field():
    cfg = digen_config_from_dict(_composed_digen("digen.placement=disaggregated", "digen.async.max_staleness=1"))
    assert cfg.async_.max_staleness == 1


def test_unknown_keys_are_named_at_every_level():
    with pytest.raises(ConfigError, match=r"unknown config key digen.foo; valid keys under digen: .*async"):
        digen_config_from_dict(_composed_digen("+digen.foo=1"))
    with pytest.raises(ConfigError, match=r"unknown config key digen.async.max_stalenes; .*max_staleness"):
        digen_config_from_dict({"async": {"max_stalenes": 1}})
    with pytest.raises(ConfigError, match=r"unknown config key digen.sampling.sde_window.sise"):
        digen_config_from_dict({"sampling": {"sde_window": {"sise": 2}}})
    # Without `+`, Hydra's struct mode refuses the typo at composition and names it.
    with pytest.raises(ConfigCompositionException, match=r"digen.batch.group_szie"):
        compose_config(["digen.batch.group_szie=4"])


def test_wrong_types_are_named():
    with pytest.raises(ConfigError, match=r"digen.batch.group_size='abc'"):
        digen_config_from_dict(_composed_digen("digen.batch.group_size=abc"))
    with pytest.raises(ConfigError, match=r"digen.algo.betas\[1\]"):
        digen_config_from_dict({"algo": {"betas": [0.9, "x"]}})


@pytest.mark.parametrize("key", ["algo.lr", "algo.clip_range", "sampling.noise_level", "task_timeout_s", "algo.kl_beta"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_numbers_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"digen.{key}={value}; must be a finite number"):
        digen_config_from_dict(_composed_digen(f"digen.{key}={value}"))


def test_sde_window_is_the_sampler_type():
    from verl_digen.algos.window import SdeWindowConfig

    cfg = digen_config_from_dict({"sampling": {"num_steps": 6, "sde_window": {"mode": "fixed", "start": 1, "size": 3}}})
    assert cfg.sampling.sde_window == SdeWindowConfig(mode="fixed", start=1, size=3)
    with pytest.raises(ConfigError, match=r"digen.sampling.sde_window: sde_window.size=9"):
        digen_config_from_dict({"sampling": {"sde_window": {"mode": "fixed", "size": 9}}})


# (digen overrides, the StrategySpec that says the same, the field both name)
SAME_RULES = [
    ({"tsp": {"stages": 2}}, dict(placement="colocated", rollout_workers=2, tsp_stages=2), "tsp_stages"),
    ({"async": {"max_staleness": 1}}, dict(placement="colocated", rollout_workers=2, max_staleness=1), "max_staleness"),
    ({"tag": {"enable": True}}, dict(placement="colocated", rollout_workers=2, tag=True), "tag"),
    ({"placement": "disaggregated", "pools": {"rollout": {"devices": 3}}, "tsp": {"stages": 2}},
     dict(placement="disaggregated", rollout_workers=3, tsp_stages=2), "tsp_stages"),
    ({"placement": "disaggregated", "tsp": {"stages": 9}},
     dict(placement="disaggregated", rollout_workers=9, tsp_stages=9), "tsp_stages"),
    ({"batch": {"groups_per_task": 3}}, dict(placement="colocated", rollout_workers=2, groups_per_task=3),
     "groups_per_task"),
    ({"placement": "sideways"}, dict(placement="sideways", rollout_workers=2), "placement"),
]
KEYS = {"tsp_stages": "digen.tsp.stages", "max_staleness": "digen.async.max_staleness", "tag": "digen.tag.enable",
        "groups_per_task": "digen.batch.groups_per_task", "placement": "digen.placement"}


@pytest.mark.parametrize("digen,spec,field", SAME_RULES)
def test_config_and_strategy_share_one_set_of_rules(digen, spec, field):
    spec = dict(dict(trainer_workers=1, groups_per_step=4, group_size=4, num_steps=8), **spec)
    checked = {k: v for k, v in spec.items() if k not in ("trainer_workers", "group_size")}
    assert [f for f, _ in strategy_violations(**checked)] == [field]
    with pytest.raises(ValueError, match=rf"^{field}="):
        StrategySpec(**spec)
    with pytest.raises(ConfigError, match=rf"invalid config: {KEYS[field]}="):
        digen_config_from_dict(digen)


def test_pools_are_checked_against_the_cluster_in_the_schema():
    cfg = digen_config_from_dict({"placement": "disaggregated", "pools": {"rollout": {"devices": 2}}})
    cfg.pools.validate_cluster("digen.pools", 4, 1)
    with pytest.raises(ConfigError, match=r"digen.pools need 3 devices"):
        cfg.pools.validate_cluster("digen.pools", 2, 1)


def test_pools_of_any_size_the_cluster_holds_validate():
    """``devices`` without ``nodes`` is the pool's total: 10 + 22 on 4 x 8, pools filling part of
    a node and sharing it. ``nodes=k`` keeps its meaning (devices on each of k nodes)."""
    from verl_digen.config.verl_keys import VerlTrainerKeys
    from verl_digen.placement.pools import cluster_from_trainer_keys, pool_layout

    overrides = ["digen.placement=disaggregated", "trainer.nnodes=4", "trainer.n_gpus_per_node=8",
                 "digen.pools.rollout.devices=10", "digen.pools.trainer.devices=22"]
    container = OmegaConf.to_container(compose_config(overrides), resolve=True)
    cfg = digen_config_from_dict(container["digen"])
    layout = pool_layout(cfg, cluster_from_trainer_keys(VerlTrainerKeys.of(container)))
    assert (layout.spec.rollout_workers, layout.spec.trainer_workers) == (10, 22)
    assert layout.pools["trainer"][0] == [8, 8, 6, 0] and layout.pools["rollout"][0] == [0, 0, 2, 8]
    too_big = digen_config_from_dict({**container["digen"], "pools": {"rollout": {"devices": 11},
                                                                      "trainer": {"devices": 22}}})
    with pytest.raises(ConfigError, match=r"digen.pools need 33 devices"):
        too_big.pools.validate_cluster("digen.pools", 8, 4)
    per_node = digen_config_from_dict({**container["digen"], "pools": {"rollout": {"devices": 10, "nodes": 1},
                                                                       "trainer": {"devices": 22}}})
    with pytest.raises(ConfigError, match=r"rollout.devices=10 per node \(digen.pools.rollout.nodes=1\) exceeds "
                                          r"trainer.n_gpus_per_node=8; unset digen.pools.rollout.nodes"):
        per_node.pools.validate_cluster("digen.pools", 8, 4)
    two = digen_config_from_dict({**container["digen"], "pools": {"rollout": {"devices": 5, "nodes": 2}}})
    assert two.pools.rollout.world_size == 10
    with pytest.raises(ConfigError, match=r"digen.pools.trainer.nodes=0; must be >= 1, or unset"):
        digen_config_from_dict({**container["digen"], "pools": {"trainer": {"devices": 4, "nodes": 0}}})


def test_a_reward_pool_with_colocated_placement_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"digen.pools.reward.devices=2; a reward pool needs digen.placement=disaggregated"):
        digen_config_from_dict({"placement": "colocated", "pools": {"reward": {"devices": 2}}}).validate()
    digen_config_from_dict({"placement": "disaggregated", "pools": {"reward": {"devices": 2}}}).validate()


def _hydra_compose(overrides: list[str], config_name: str = "digen_trainer", config_dir: str = PACKAGED):
    """Hydra's whole composition, every time: what compose_config composed before its cache."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def _same_config(a, b) -> None:
    assert OmegaConf.to_yaml(a) == OmegaConf.to_yaml(b)  # keys in order, values unresolved
    assert OmegaConf.to_container(a, resolve=True) == OmegaConf.to_container(b, resolve=True)
    assert OmegaConf.is_struct(a) and OmegaConf.is_struct(b)
    assert OmegaConf.get_type(a.trainer) is OmegaConf.get_type(b.trainer)


# (config name, overrides, the config-group overrides among them)
OVERRIDE_SETS = [
    ("digen_trainer", [], ()),
    ("digen_trainer", ["digen.batch.group_size=4", "trainer.logger=[]", "digen.algo.betas=[0.8,0.99]"], ()),
    ("digen_trainer", ["+digen.foo=1", "~digen.algo.lr", "++trainer.nnodes=3", "++digen.bar={a: 1}"], ()),
    ("digen_trainer", ["digen.placement=disaggregated", "digen.pools.rollout.devices=3",
                       "actor_rollout_ref.actor.optim.lr=3e-4", "digen.model.path=null"], ()),
    ("flux_colocated", ["+smoke=tiny", "digen.sampling.num_steps=6"], ("+smoke=tiny",)),
    ("wan_disaggregated", ["trainer.n_gpus_per_node=4", "+smoke=tiny"], ("+smoke=tiny",)),
    ("digits", ["data.train_batch_size=8", "digen.seed=7"], ()),
]


def _verl_config_dir() -> str:
    import verl

    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


# veRL's own ppo_trainer (what main_ppo composes; test_verl_keys.py and test_omni_keys.py compose it
# with compose_config)
VERL_OVERRIDE_SETS = [
    ("ppo_trainer", [], ()),
    ("ppo_trainer", ["trainer.v1.trainer_mode=digen", "+ray_kwargs.ray_init.num_cpus=4",
                     "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"], ()),
    ("ppo_trainer", ["data.train_batch_size=3", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_epochs=3",
                     "actor_rollout_ref.model.lora_rank=16", "model_engine=dp"], ("model_engine=dp",)),
]


@pytest.mark.parametrize("config_name, overrides, groups", OVERRIDE_SETS + VERL_OVERRIDE_SETS)
def test_composing_from_the_cached_defaults_is_hydras_composition(config_name, overrides, groups):
    """compose_config composes the defaults list once and applies key overrides to a copy: the
    config is Hydra's own, a second time (from the cache) too, and changing it leaves the next alone."""
    from verl_digen.config import compose

    config_dir = _verl_config_dir() if config_name == "ppo_trainer" else PACKAGED
    expected = _hydra_compose(overrides, config_name, config_dir)
    first = compose_config(overrides, config_name=config_name, config_dir=config_dir)
    assert (os.path.abspath(config_dir), config_name, groups) in compose._BASES  # the cached path ran
    second = compose_config(overrides, config_name=config_name, config_dir=config_dir)
    _same_config(first, expected)
    _same_config(second, expected)
    with open_dict(first):
        first.trainer.nnodes = 99
    _same_config(compose_config(overrides, config_name=config_name, config_dir=config_dir), expected)


def test_a_composition_from_files_an_earlier_one_loaded_is_hydras_composition(monkeypatch):
    """Compositions share their YAML loads (compose._SharedLoads): a preset composed after another
    reads veRL's files from the first one's loads, not the disk, and is Hydra's own composition,
    though the first one (Hydra's whole composition: a ``hydra.*`` override) set keys in place on
    the nodes it merged from those loads."""
    from hydra._internal.config_repository import ConfigRepository

    from verl_digen.config import compose

    monkeypatch.setattr(compose, "_LOADS", {})
    monkeypatch.setattr(compose, "_BASES", {})  # compose the defaults lists, no cached bases
    first = compose_config(["+smoke=tiny", "hydra.job.name=first", "trainer.nnodes=99",
                            "actor_rollout_ref.actor.optim.lr=7.0"], config_name="flux_colocated", config_dir=PACKAGED)
    assert compose._LOADS and first.trainer.nnodes == 99 and first.actor_rollout_ref.actor.optim.lr == 7.0
    read = []
    load = ConfigRepository.load_config
    monkeypatch.setattr(ConfigRepository, "load_config", lambda self, config_path: read.append(config_path) or load(self, config_path))
    second = compose_config(["+smoke=tiny"], config_name="sd3_disaggregated", config_dir=PACKAGED)
    assert "sd3_disaggregated" in read and "ppo_trainer" not in read and "digen_base" not in read  # shared loads
    monkeypatch.setattr(ConfigRepository, "load_config", load)
    _same_config(second, _hydra_compose(["+smoke=tiny"], "sd3_disaggregated", PACKAGED))
    _same_config(compose_config(["+smoke=tiny"], config_name="flux_colocated", config_dir=PACKAGED),
                 _hydra_compose(["+smoke=tiny"], "flux_colocated", PACKAGED))


@pytest.mark.parametrize("overrides", [
    ["digen.batch.group_szie=4"],  # a typo under struct mode
    ["+digen.batch.group_size=4"],  # + on a key that exists
    ["~digen.algo.nothing"],  # deleting what is not there
    ["+smoke=missing"],  # a config-group option that does not exist
    ["digen.batch.group_size=[1,2"],  # not an override
])
def test_refused_overrides_raise_hydras_own_error(overrides):
    with pytest.raises(Exception) as ours:
        compose_config(overrides)
    with pytest.raises(Exception) as hydras:
        _hydra_compose(overrides)
    assert type(ours.value) is type(hydras.value) and str(ours.value) == str(hydras.value)


def test_an_edited_preset_or_config_store_node_is_composed_again(tmp_path):
    """The cached composition is keyed by the files it read and the ConfigStore's nodes: a
    notebook that edits a preset, or stores a node again, composes the new one."""
    import shutil

    from hydra.core.config_store import ConfigStore

    from verl_digen.config.schema import hydra_defaults

    configs = tmp_path / "configs"
    shutil.copytree(PACKAGED, configs)
    preset = configs / "mine.yaml"
    primary = (configs / "digen_trainer.yaml").read_text()  # its hydra.searchpath finds veRL's config
    preset.write_text(primary + "trainer:\n  nnodes: 2\n")
    assert compose_config([], config_name="mine", config_dir=str(configs)).trainer.nnodes == 2
    preset.write_text(primary + "trainer:\n  nnodes: 30\n")
    assert compose_config([], config_name="mine", config_dir=str(configs)).trainer.nnodes == 30
    _same_config(compose_config([], config_name="mine", config_dir=str(configs)),
                 _hydra_compose([], "mine", str(configs)))

    store = ConfigStore.instance()
    node = hydra_defaults()
    node["seed"] = 1234
    store.store(name="digen_defaults", node=node, package="digen")
    try:
        assert compose_config([]).digen.seed == 1234
    finally:
        store.store(name="digen_defaults", node=hydra_defaults(), package="digen")
    assert compose_config([]).digen.seed == DigenConfig().seed
