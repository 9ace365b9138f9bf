"""Placement: which Ray resource pools exist and which worker role lives on which."""

from verl_digen.placement.pools import (  # noqa: F401
    ClusterSpec,
    PoolLayout,
    build_worker_groups,
    cluster_from_trainer_keys,
    pool_layout,
)
