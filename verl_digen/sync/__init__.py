"""Versioned trainer -> rollout weight sync over a private process group.

- :mod:`verl_digen.sync.state`: which tensors a sync carries and how they are packed.
- :mod:`verl_digen.sync.transport`: :class:`WeightChannel` (the broadcast group) and
  :class:`WeightSyncMixin` (worker-side endpoints).
- :mod:`verl_digen.sync.checkpoint_engine`: the same channel as veRL checkpoint-engine backend
  ``"digen_gloo"`` (imported lazily: it pulls in veRL's rollout stack).
"""

from verl_digen.sync.state import (
    FlatMetadata,
    TensorSlot,
    flatten_state,
    iter_buckets,
    load_trainable_state,
    state_digest,
    state_nbytes,
    trainable_state,
    unflatten_state,
)
from verl_digen.sync.transport import (
    SyncStats,
    WeightChannel,
    WeightSyncMixin,
    find_free_port,
    node_ip_address,
)

__all__ = [
    "FlatMetadata",
    "SyncStats",
    "TensorSlot",
    "WeightChannel",
    "WeightSyncMixin",
    "find_free_port",
    "flatten_state",
    "iter_buckets",
    "load_trainable_state",
    "node_ip_address",
    "state_digest",
    "state_nbytes",
    "trainable_state",
    "unflatten_state",
]
