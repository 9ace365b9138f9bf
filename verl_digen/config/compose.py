"""Compose the main job's config programmatically (tests, compare, notebooks)."""

from __future__ import annotations

import os

from omegaconf import DictConfig

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
CONFIG_NAME = "digen_trainer"


def compose_config(
    overrides: list[str] | None = None, *, config_name: str = CONFIG_NAME, config_dir: str = CONFIG_DIR
) -> DictConfig:
    """The config ``python -m verl_digen.main [--config-dir D --config-name N] overrides`` would see."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides or []))
