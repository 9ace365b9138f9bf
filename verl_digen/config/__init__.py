"""Typed configuration of the ``digen`` group and its up-front validation."""

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
)
