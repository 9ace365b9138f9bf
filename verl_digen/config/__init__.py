"""Typed configuration of the ``digen`` group and its up-front validation.

Importing this package registers the ``digen`` defaults (the dataclasses of
:mod:`verl_digen.config.schema`) in Hydra's ConfigStore, where ``digen_base.yaml`` finds them.
"""

from verl_digen.config.schema import (  # noqa: F401
    AlgoConfig,
    AsyncConfig,
    BatchConfig,
    ConfigError,
    DataConfig,
    DigenConfig,
    GapConfig,
    LoraConfigSpec,
    ModelConfig,
    PoolSpec,
    PoolsConfig,
    RewardConfig,
    SamplingConfig,
    SyncConfig,
    digen_config_from_dict,
    register_configs,
)

register_configs()
