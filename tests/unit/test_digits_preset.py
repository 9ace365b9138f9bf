"""The packaged ``digits`` preset (FlowGRPO on the pretrained toy generator with the digit-classifier
reward): it ships inside the package, composes and validates. The main CLI finding it by name from
any directory, and a CI-sized run of it (fewer steps) raising the reward:
tests/e2e/test_digits_preset_e2e.py."""

from __future__ import annotations

import fnmatch
import os
import re

import pytest
from omegaconf import OmegaConf

from verl_digen.config.compose import compose_config, presets_dir
from verl_digen.config.schema import digen_config_from_dict

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
# A CI-sized run: the preset with fewer steps (its default is 200; docs/results_cpu.md has that curve).
CI_STEPS = 60


def test_preset_is_shipped():
    """digits.yaml is a preset of configs/, which setup.py copies into the wheel's
    verl_digen/config/ (tests/unit/test_packaging.py checks the wheel); its prompts are package data."""
    assert os.path.isfile(os.path.join(ROOT, "configs", "digits.yaml"))
    assert os.path.isfile(os.path.join(presets_dir(), "digits.yaml"))
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pyproject = f.read()  # (tomllib is Python 3.11+; the project supports 3.10)
    package_data = re.search(r"\[tool\.setuptools\.package-data\]\s*(?:#.*\n)*verl_digen = \[(.*?)\]$", pyproject, re.S | re.M)
    patterns = re.findall(r'"([^"]+)"', package_data.group(1))
    assert any(fnmatch.fnmatch("data/builtin_digits_prompts.txt", p) for p in patterns)
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    assert '"scikit-learn' in dependencies


def test_preset_composes_with_flow_grpo_settings():
    cfg = compose_config([], config_name="digits")
    digen = digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))
    assert digen.model.path is None and digen.model.tiny_arch == "digits"
    assert digen.reward.name == "digit_classifier"
    assert digen.data.prompts == "builtin:digits" and digen.validation.prompts == "builtin:digits_val"
    # Flow-GRPO's LoRA recipe: lr 3e-4, r=32, alpha=64, clip 1e-4, noise level 0.7, no CFG.
    assert digen.algo.lr == pytest.approx(3e-4) and digen.algo.clip_range == pytest.approx(1e-4)
    assert (digen.model.lora.enable, digen.model.lora.rank, digen.model.lora.alpha) == (True, 32, 64)
    assert digen.sampling.noise_level == pytest.approx(0.7) and digen.sampling.guidance_scale == 1.0
    assert (digen.sampling.height, digen.sampling.width, digen.sampling.num_steps) == (8, 8, 10)
    assert cfg.trainer.test_freq > 0 and cfg.trainer.val_before_train is True
    assert cfg.trainer.total_training_steps > CI_STEPS
