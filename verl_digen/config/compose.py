"""Compose the main job's config programmatically (tests, compare, notebooks)."""

from __future__ import annotations

import os

from omegaconf import DictConfig

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
CONFIG_NAME = "digen_trainer"


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides or []))
