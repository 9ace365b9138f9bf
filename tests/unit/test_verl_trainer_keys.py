"""veRL's ``trainer.*`` keys are read once, typed (``VerlTrainerKeys``): each default is written
in one place and is veRL's own, a bad value stops the run naming its key, and no other module
reads a trainer key with a default of its own."""

from __future__ import annotations

import ast
import os
from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import ConfigError
from verl_digen.config.verl_keys import DIGEN_MAIN, VerlTrainerKeys, resolve_run_config, verl_defaults

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "verl_digen")


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


def test_every_default_is_veRLs_own():
    defaults = verl_defaults()
    for f in fields(VerlTrainerKeys):
        verl = _lookup(defaults, VerlTrainerKeys.key(f.name))
        ours = f.default
        if isinstance(verl, str) and "${" in verl:  # an interpolation: None here, derived by the view
            assert ours is None, f.name
            continue
        assert (list(ours) if isinstance(ours, tuple) else ours) == verl, f"{VerlTrainerKeys.key(f.name)}: {ours!r} vs {verl!r}"


def test_a_missing_key_takes_its_one_default():
    assert VerlTrainerKeys.of({}) == VerlTrainerKeys() == VerlTrainerKeys.of({"trainer": {}})
    keys = VerlTrainerKeys.of({"trainer": {"project_name": "p", "experiment_name": "e"}})
    assert keys.checkpoint_root == os.path.join("checkpoints", "p", "e")  # veRL's interpolation
    assert VerlTrainerKeys(default_local_dir="/ck").checkpoint_root == "/ck"


def test_the_keys_are_read_as_veRL_writes_them():
    keys = VerlTrainerKeys.of({"trainer": {"logger": "console", "test_freq": None, "save_freq": None,
                                           "experiment_name": 2024, "v1": {"trainer_mode": "digen"}}})
    assert keys.logger == ("console",) and keys.test_freq == -1 and keys.save_freq == -1
    assert keys.experiment_name == "2024" and keys.trainer_mode == "digen"
    assert VerlTrainerKeys.of({"trainer": {"logger": None}}).logger == ()  # no backend


def test_a_composed_run_config_carries_its_trainer_keys():
    container = OmegaConf.to_container(compose_config(["trainer.test_freq=3", "trainer.logger=[console,file]"]),
                                       resolve=True)
    keys = resolve_run_config(container, DIGEN_MAIN).trainer
    assert keys.test_freq == 3 and keys.logger == ("console", "file") and keys.n_gpus_per_node == 2
    assert keys.checkpoint_root == container["trainer"]["default_local_dir"]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("total_training_steps", 0, r"trainer.total_training_steps=0; must be a positive integer"),
    ("n_gpus_per_node", 0, r"trainer.n_gpus_per_node=0; must be a positive integer"),
    ("nnodes", True, r"trainer.nnodes=True; must be a positive integer"),
    ("device", "npu", r"trainer.device='npu'; valid: cuda, cpu"),
    ("val_before_train", "yes", r"trainer.val_before_train='yes'; must be true or false"),
    ("test_freq", "often", r"trainer.test_freq='often'; must be an integer"),
    ("save_freq", 1.5, r"trainer.save_freq=1.5; must be an integer"),
    ("resume_mode", "latest", r"trainer.resume_mode='latest'; valid: auto, disable, resume_path"),
    ("logger", 5, r"trainer.logger=5; must be a backend name or a list of them"),
    ("max_actor_ckpt_to_keep", "all", r"trainer.max_actor_ckpt_to_keep='all'"),
    ("use_v1", False, r"trainer.use_v1=False; the digen trainer mode is a v1 trainer"),
])
def test_a_bad_value_is_named_with_its_key(key, value, message):
    with pytest.raises(ConfigError, match=rf"^invalid config: {message}"):
        VerlTrainerKeys.of({"trainer": {key: value}})


def test_resume_path_needs_its_path():
    with pytest.raises(ConfigError, match=r"trainer.resume_mode=resume_path needs trainer.resume_from_path"):
        VerlTrainerKeys(resume_mode="resume_path")


def test_total_epochs_is_checked_only_when_it_counts_the_steps():
    assert VerlTrainerKeys(total_training_steps=5, total_epochs=None).steps_for(3, 4) == 5
    assert VerlTrainerKeys(total_epochs=3).steps_for(32, 4) == 24
    with pytest.raises(ConfigError, match=r"trainer.total_epochs=0; must be a positive integer"):
        VerlTrainerKeys(total_epochs=0).steps_for(32, 4)
    with pytest.raises(ConfigError, match=r"trainer.total_training_steps=None: 3 training prompts make no whole batch"):
        VerlTrainerKeys().steps_for(3, 4)


def _trainer_key_reads_with_a_default(tree: ast.Module) -> list[str]:
    """``x.get("<trainer key>", default)`` and ``_get(x, "trainer.<key>", default)`` calls."""
    names = {f.name for f in fields(VerlTrainerKeys)}
    full = {VerlTrainerKeys.key(n) for n in names}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        args = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if func == "get" and len(node.args) == 2 and args[:1] and args[0] in names | full:
            found.append(f"line {node.lineno}: get({args[0]!r}, ...)")
        elif func == "_get" and len(node.args) == 3 and any(a in full for a in args):
            found.append(f"line {node.lineno}: _get(..., {args[0]!r}, ...)")
    return found


def test_no_module_reads_a_trainer_key_with_a_default_of_its_own():
    bad = {}
    for dirpath, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    found = _trainer_key_reads_with_a_default(ast.parse(f.read(), path))
                if found:
                    bad[os.path.relpath(path, PKG)] = found
    assert not bad, f"read these through VerlTrainerKeys (one default each): {bad}"
    # The scan finds the reads it is meant to refuse.
    assert _trainer_key_reads_with_a_default(ast.parse('t.get("test_freq", -1); _get(c, "trainer.nnodes", 1)'))
