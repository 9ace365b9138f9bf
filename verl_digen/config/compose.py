"""Where the presets are, and the main job's config composed programmatically (tests, compare,
notebooks).

The presets live in ``configs/`` at the root of a checkout (an editable install reads them there)
and the wheel ships them inside the package, in this directory (setup.py copies them): either
way ``--config-name <preset>`` finds them from any working directory.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

CONFIG_NAME = "digen_trainer"
_PACKAGED = os.path.dirname(os.path.abspath(__file__))  # an installed wheel
_CHECKOUT = os.path.join(os.path.dirname(os.path.dirname(_PACKAGED)), "configs")  # a checkout


def presets_dir() -> str:
    """The directory holding ``digen_trainer.yaml`` and the presets: this package's own in an
    installed wheel, else the checkout's ``configs/``."""
    if os.path.isfile(os.path.join(_PACKAGED, f"{CONFIG_NAME}.yaml")):
        return _PACKAGED
    return _CHECKOUT


CONFIG_DIR = presets_dir()


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
