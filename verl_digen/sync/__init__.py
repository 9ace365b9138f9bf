"""Versioned trainer -> rollout weight sync over a private process group.

- :mod:`verl_digen.sync.state`: which tensors a sync carries and how they are packed.
- :mod:`verl_digen.sync.transport`: :class:`WeightChannel` (the broadcast group) and
  :class:`WeightSyncMixin` (worker-side endpoints).
- :mod:`verl_digen.sync.checkpoint_engine`: the same channel as veRL checkpoint-engine backend
  ``"digen_gloo"`` (imported lazily: it pulls in veRL's rollout stack).
- :mod:`verl_digen.sync.buckets`: the bucket size, which the memory planner reads too.

The names below are imported on first use (:mod:`verl_digen.lazy`): the memory planner imports
``sync.buckets`` without importing torch.
"""

from verl_digen.lazy import lazy_exports

_WHERE = {
    **dict.fromkeys(["FlatMetadata", "TensorSlot", "flatten_state", "iter_buckets", "load_trainable_state",
                     "state_digest", "state_nbytes", "trainable_state", "unflatten_state"], "state"),
    **dict.fromkeys(["SyncStats", "WeightChannel", "WeightSyncMixin", "find_free_port", "node_ip_address"], "transport"),
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
